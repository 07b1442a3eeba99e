//! Symbols that programs and the libraries they load bind at start-up (every Debian RDMA binary
//! is linked `BIND_NOW`) but that this library does not offer yet: each fails the way
//! libibverbs reports failure (NULL or -1, `errno` = `ENOSYS`) with one line on stderr, so
//! the program stops with its own error message ("Couldn't allocate PD") instead of
//! "symbol lookup error" before `main`. The `IBVERBS_PRIVATE_34` ones are rdma-core's
//! provider interface, imported by `libmlx5`/`libefa` (which perftest links): their load-time
//! `verbs_register_driver_34` is accepted and ignored; the rest are never called for a
//! backplane device. The list is what ibverbs-utils and perftest 4.5 import
//! (`nm -D --undefined-only`), with rdma-core 44's version tags.

use std::ffi::{c_int, c_void};

fn not_offered(name: &str) {
    eprintln!("libibverbs (backplane): {name} is not offered yet on backplane devices");
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
}

/// `ibv_dofork_range`/`ibv_dontfork_range`: nothing to do, fabric memory is not pinned by a
/// device, so a forked child never breaks a registration.
macro_rules! zero {
    ($imp:ident, $sym:literal) => {
        #[no_mangle]
        pub extern "C" fn $imp() -> c_int {
            0
        }
        crate::abi::symver!($imp, $sym);
    };
}
macro_rules! void {
    ($imp:ident, $sym:literal) => {
        #[no_mangle]
        pub extern "C" fn $imp() {}
        crate::abi::symver!($imp, $sym);
    };
}
macro_rules! null {
    ($imp:ident, $name:literal, $sym:literal) => {
        #[no_mangle]
        pub extern "C" fn $imp() -> *mut c_void {
            not_offered($name);
            std::ptr::null_mut()
        }
        crate::abi::symver!($imp, $sym);
    };
}
macro_rules! fail {
    ($imp:ident, $name:literal, $sym:literal) => {
        #[no_mangle]
        pub extern "C" fn $imp() -> c_int {
            not_offered($name);
            -1
        }
        crate::abi::symver!($imp, $sym);
    };
}

void!(bp_stub_verbs_log, "__verbs_log@@IBVERBS_PRIVATE_34");
null!(
    bp_stub_verbs_init_and_alloc_context,
    "_verbs_init_and_alloc_context",
    "_verbs_init_and_alloc_context@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_execute_ioctl,
    "execute_ioctl",
    "execute_ioctl@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_attach_mcast,
    "ibv_attach_mcast",
    "ibv_attach_mcast@@IBVERBS_1.1"
);
fail!(
    bp_stub_ibv_cmd_advise_mr,
    "ibv_cmd_advise_mr",
    "ibv_cmd_advise_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_alloc_dm,
    "ibv_cmd_alloc_dm",
    "ibv_cmd_alloc_dm@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_alloc_mw,
    "ibv_cmd_alloc_mw",
    "ibv_cmd_alloc_mw@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_alloc_pd,
    "ibv_cmd_alloc_pd",
    "ibv_cmd_alloc_pd@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_attach_mcast,
    "ibv_cmd_attach_mcast",
    "ibv_cmd_attach_mcast@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_close_xrcd,
    "ibv_cmd_close_xrcd",
    "ibv_cmd_close_xrcd@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_ah,
    "ibv_cmd_create_ah",
    "ibv_cmd_create_ah@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_counters,
    "ibv_cmd_create_counters",
    "ibv_cmd_create_counters@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_cq_ex,
    "ibv_cmd_create_cq_ex",
    "ibv_cmd_create_cq_ex@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_flow,
    "ibv_cmd_create_flow",
    "ibv_cmd_create_flow@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_flow_action_esp,
    "ibv_cmd_create_flow_action_esp",
    "ibv_cmd_create_flow_action_esp@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_qp_ex2,
    "ibv_cmd_create_qp_ex2",
    "ibv_cmd_create_qp_ex2@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_qp_ex,
    "ibv_cmd_create_qp_ex",
    "ibv_cmd_create_qp_ex@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_rwq_ind_table,
    "ibv_cmd_create_rwq_ind_table",
    "ibv_cmd_create_rwq_ind_table@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_srq,
    "ibv_cmd_create_srq",
    "ibv_cmd_create_srq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_srq_ex,
    "ibv_cmd_create_srq_ex",
    "ibv_cmd_create_srq_ex@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_create_wq,
    "ibv_cmd_create_wq",
    "ibv_cmd_create_wq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_dealloc_mw,
    "ibv_cmd_dealloc_mw",
    "ibv_cmd_dealloc_mw@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_dealloc_pd,
    "ibv_cmd_dealloc_pd",
    "ibv_cmd_dealloc_pd@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_dereg_mr,
    "ibv_cmd_dereg_mr",
    "ibv_cmd_dereg_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_ah,
    "ibv_cmd_destroy_ah",
    "ibv_cmd_destroy_ah@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_counters,
    "ibv_cmd_destroy_counters",
    "ibv_cmd_destroy_counters@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_cq,
    "ibv_cmd_destroy_cq",
    "ibv_cmd_destroy_cq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_flow,
    "ibv_cmd_destroy_flow",
    "ibv_cmd_destroy_flow@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_flow_action,
    "ibv_cmd_destroy_flow_action",
    "ibv_cmd_destroy_flow_action@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_qp,
    "ibv_cmd_destroy_qp",
    "ibv_cmd_destroy_qp@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_rwq_ind_table,
    "ibv_cmd_destroy_rwq_ind_table",
    "ibv_cmd_destroy_rwq_ind_table@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_srq,
    "ibv_cmd_destroy_srq",
    "ibv_cmd_destroy_srq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_destroy_wq,
    "ibv_cmd_destroy_wq",
    "ibv_cmd_destroy_wq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_detach_mcast,
    "ibv_cmd_detach_mcast",
    "ibv_cmd_detach_mcast@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_free_dm,
    "ibv_cmd_free_dm",
    "ibv_cmd_free_dm@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_get_context,
    "ibv_cmd_get_context",
    "ibv_cmd_get_context@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_modify_cq,
    "ibv_cmd_modify_cq",
    "ibv_cmd_modify_cq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_modify_flow_action_esp,
    "ibv_cmd_modify_flow_action_esp",
    "ibv_cmd_modify_flow_action_esp@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_modify_qp,
    "ibv_cmd_modify_qp",
    "ibv_cmd_modify_qp@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_modify_qp_ex,
    "ibv_cmd_modify_qp_ex",
    "ibv_cmd_modify_qp_ex@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_modify_srq,
    "ibv_cmd_modify_srq",
    "ibv_cmd_modify_srq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_modify_wq,
    "ibv_cmd_modify_wq",
    "ibv_cmd_modify_wq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_open_qp,
    "ibv_cmd_open_qp",
    "ibv_cmd_open_qp@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_open_xrcd,
    "ibv_cmd_open_xrcd",
    "ibv_cmd_open_xrcd@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_query_context,
    "ibv_cmd_query_context",
    "ibv_cmd_query_context@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_query_device_any,
    "ibv_cmd_query_device_any",
    "ibv_cmd_query_device_any@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_query_mr,
    "ibv_cmd_query_mr",
    "ibv_cmd_query_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_query_port,
    "ibv_cmd_query_port",
    "ibv_cmd_query_port@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_query_qp,
    "ibv_cmd_query_qp",
    "ibv_cmd_query_qp@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_query_srq,
    "ibv_cmd_query_srq",
    "ibv_cmd_query_srq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_read_counters,
    "ibv_cmd_read_counters",
    "ibv_cmd_read_counters@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_reg_dm_mr,
    "ibv_cmd_reg_dm_mr",
    "ibv_cmd_reg_dm_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_reg_dmabuf_mr,
    "ibv_cmd_reg_dmabuf_mr",
    "ibv_cmd_reg_dmabuf_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_reg_mr,
    "ibv_cmd_reg_mr",
    "ibv_cmd_reg_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_rereg_mr,
    "ibv_cmd_rereg_mr",
    "ibv_cmd_rereg_mr@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_cmd_resize_cq,
    "ibv_cmd_resize_cq",
    "ibv_cmd_resize_cq@@IBVERBS_PRIVATE_34"
);
fail!(
    bp_stub_ibv_copy_ah_attr_from_kern,
    "ibv_copy_ah_attr_from_kern",
    "ibv_copy_ah_attr_from_kern@@IBVERBS_1.1"
);
fail!(
    bp_stub_ibv_copy_path_rec_from_kern,
    "ibv_copy_path_rec_from_kern",
    "ibv_copy_path_rec_from_kern@@IBVERBS_1.0"
);
fail!(
    bp_stub_ibv_copy_qp_attr_from_kern,
    "ibv_copy_qp_attr_from_kern",
    "ibv_copy_qp_attr_from_kern@@IBVERBS_1.0"
);
null!(
    bp_stub_ibv_create_ah_from_wc,
    "ibv_create_ah_from_wc",
    "ibv_create_ah_from_wc@@IBVERBS_1.1"
);
fail!(
    bp_stub_ibv_detach_mcast,
    "ibv_detach_mcast",
    "ibv_detach_mcast@@IBVERBS_1.1"
);
zero!(bp_stub_ibv_dofork_range, "ibv_dofork_range@@IBVERBS_1.1");
zero!(
    bp_stub_ibv_dontfork_range,
    "ibv_dontfork_range@@IBVERBS_1.1"
);
fail!(
    bp_stub_ibv_get_pkey_index,
    "ibv_get_pkey_index",
    "ibv_get_pkey_index@@IBVERBS_1.5"
);
/// `ibv_get_sysfs_path` (librdmacm reads its ABI version below it): where sysfs is.
#[no_mangle]
pub extern "C" fn bp_ibv_get_sysfs_path() -> *const std::ffi::c_char {
    c"/sys".as_ptr()
}
crate::abi::symver!(bp_ibv_get_sysfs_path, "ibv_get_sysfs_path@@IBVERBS_1.0");
fail!(
    bp_stub_ibv_query_ece,
    "ibv_query_ece",
    "ibv_query_ece@@IBVERBS_1.10"
);
fail!(
    bp_stub_ibv_resolve_eth_l2_from_gid,
    "ibv_resolve_eth_l2_from_gid",
    "ibv_resolve_eth_l2_from_gid@@IBVERBS_1.1"
);
fail!(
    bp_stub_ibv_set_ece,
    "ibv_set_ece",
    "ibv_set_ece@@IBVERBS_1.10"
);
fail!(
    bp_stub_verbs_allow_disassociate_destroy,
    "verbs_allow_disassociate_destroy",
    "verbs_allow_disassociate_destroy@@IBVERBS_PRIVATE_34"
);
void!(bp_stub_verbs_init_cq, "verbs_init_cq@@IBVERBS_PRIVATE_34");
null!(
    bp_stub_verbs_open_device,
    "verbs_open_device",
    "verbs_open_device@@IBVERBS_PRIVATE_34"
);
void!(
    bp_stub_verbs_register_driver_34,
    "verbs_register_driver_34@@IBVERBS_PRIVATE_34"
);
void!(bp_stub_verbs_set_ops, "verbs_set_ops@@IBVERBS_PRIVATE_34");
void!(
    bp_stub_verbs_uninit_context,
    "verbs_uninit_context@@IBVERBS_PRIVATE_34"
);
