//! Links `libibverbs.so` the way programs built against rdma-core expect it: soname
//! `libibverbs.so.1` and rdma-core's version nodes (the symbols are put in them by `.symver`
//! lines next to each function, see `src/abi.rs`), and checks our `#[repr(C)]` mirrors of
//! `<infiniband/verbs.h>` against the header when it is installed (`libibverbs-dev`, which
//! `scripts/setup.sh` installs): the sizes and offsets gcc reports become compile-time
//! assertions, so the layouts cannot drift from the header.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

/// rdma-core 44's version nodes (`libibverbs/libibverbs.map.in`). Only declared: a node that
/// lists symbols would be overridden by rustc's own anonymous version script.
const NODES: &[&str] = &[
    "IBVERBS_1.0",
    "IBVERBS_1.1",
    "IBVERBS_1.5",
    "IBVERBS_1.6",
    "IBVERBS_1.7",
    "IBVERBS_1.8",
    "IBVERBS_1.9",
    "IBVERBS_1.10",
    "IBVERBS_1.11",
    "IBVERBS_1.12",
    "IBVERBS_1.13",
    "IBVERBS_1.14",
    "IBVERBS_PRIVATE_34",
];

/// A C struct, its Rust mirror, and (C field, Rust field) pairs whose offsets must agree.
type Layout = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// The structs whose layouts must agree with the header.
const LAYOUTS: &[Layout] = &[
    (
        "struct ibv_device",
        "IbvDevice",
        &[
            ("node_type", "node_type"),
            ("transport_type", "transport_type"),
            ("name", "name"),
            ("dev_name", "dev_name"),
            ("dev_path", "dev_path"),
            ("ibdev_path", "ibdev_path"),
        ],
    ),
    (
        "struct ibv_context",
        "IbvContext",
        &[
            ("device", "device"),
            ("ops.poll_cq", "ops.poll_cq"),
            ("ops.req_notify_cq", "ops.req_notify_cq"),
            ("ops.post_srq_recv", "ops.post_srq_recv"),
            ("ops.post_send", "ops.post_send"),
            ("ops.post_recv", "ops.post_recv"),
            ("cmd_fd", "cmd_fd"),
            ("async_fd", "async_fd"),
            ("num_comp_vectors", "num_comp_vectors"),
            ("mutex", "mutex"),
            ("abi_compat", "abi_compat"),
        ],
    ),
    (
        "struct verbs_context",
        "VerbsContext",
        &[
            ("query_port", "head.ops_a"),
            ("create_cq_ex", "head.create_cq_ex"),
            ("priv", "head.priv_"),
            ("query_device_ex", "head.query_device_ex"),
            ("ibv_destroy_flow", "head.ops_b"),
            ("create_qp_ex", "head.create_qp_ex"),
            ("close_xrcd", "head.close_xrcd"),
            ("sz", "head.sz"),
            ("context", "context"),
        ],
    ),
    (
        "struct ibv_async_event",
        "IbvAsyncEvent",
        &[("element", "element"), ("event_type", "event_type")],
    ),
    (
        "struct ibv_device_attr_ex",
        "IbvDeviceAttrEx",
        &[
            ("comp_mask", "comp_mask"),
            ("odp_caps", "_odp_caps"),
            ("completion_timestamp_mask", "completion_timestamp_mask"),
            ("hca_core_clock", "hca_core_clock"),
            ("device_cap_flags_ex", "_rest"),
        ],
    ),
    (
        "struct ibv_cq_init_attr_ex",
        "IbvCqInitAttrEx",
        &[
            ("cq_context", "cq_context"),
            ("channel", "channel"),
            ("comp_vector", "comp_vector"),
            ("wc_flags", "wc_flags"),
            ("comp_mask", "comp_mask"),
            ("flags", "flags"),
            ("parent_domain", "parent_domain"),
        ],
    ),
    (
        "struct ibv_cq_ex",
        "IbvCqEx",
        &[
            ("comp_mask", "tail.comp_mask"),
            ("status", "tail.status"),
            ("wr_id", "tail.wr_id"),
            ("start_poll", "tail.start_poll"),
            ("read_opcode", "tail.read_opcode"),
            ("read_completion_ts", "tail.read_completion_ts"),
            ("read_tm_info", "tail.read_tm_info"),
            (
                "read_completion_wallclock_ns",
                "tail.read_completion_wallclock_ns",
            ),
        ],
    ),
    (
        "struct ibv_qp_init_attr_ex",
        "IbvQpInitAttrEx",
        &[
            ("cap", "cap"),
            ("sq_sig_all", "sq_sig_all"),
            ("comp_mask", "comp_mask"),
            ("pd", "pd"),
            ("create_flags", "create_flags"),
            ("rwq_ind_tbl", "rwq_ind_tbl"),
            ("rx_hash_conf.rx_hash_key", "rx_hash_key"),
            ("source_qpn", "source_qpn"),
            ("send_ops_flags", "send_ops_flags"),
        ],
    ),
    (
        "struct ibv_data_buf",
        "IbvDataBuf",
        &[("addr", "addr"), ("length", "length")],
    ),
    (
        "struct ibv_qp_ex",
        "IbvQpEx",
        &[
            ("comp_mask", "tail.comp_mask"),
            ("wr_id", "tail.wr_id"),
            ("wr_flags", "tail.wr_flags"),
            ("wr_atomic_cmp_swp", "tail.wr_atomic_cmp_swp"),
            ("wr_rdma_read", "tail.wr_rdma_read"),
            ("wr_send", "tail.wr_send"),
            ("wr_set_ud_addr", "tail.wr_set_ud_addr"),
            ("wr_set_inline_data", "tail.wr_set_inline_data"),
            ("wr_set_sge", "tail.wr_set_sge"),
            ("wr_set_sge_list", "tail.wr_set_sge_list"),
            ("wr_start", "tail.wr_start"),
            ("wr_complete", "tail.wr_complete"),
            ("wr_abort", "tail.wr_abort"),
            ("wr_atomic_write", "tail.wr_atomic_write"),
        ],
    ),
    (
        "struct ibv_device_attr",
        "IbvDeviceAttr",
        &[
            ("node_guid", "node_guid"),
            ("max_mr_size", "max_mr_size"),
            ("vendor_id", "vendor_id"),
            ("max_qp_wr", "max_qp_wr"),
            ("max_sge", "max_sge"),
            ("max_cqe", "max_cqe"),
            ("max_qp_rd_atom", "max_qp_rd_atom"),
            ("atomic_cap", "atomic_cap"),
            ("max_srq_sge", "max_srq_sge"),
            ("max_pkeys", "max_pkeys"),
            ("phys_port_cnt", "phys_port_cnt"),
        ],
    ),
    (
        "struct ibv_port_attr",
        "IbvPortAttr",
        &[
            ("state", "state"),
            ("active_mtu", "active_mtu"),
            ("gid_tbl_len", "gid_tbl_len"),
            ("max_msg_sz", "max_msg_sz"),
            ("pkey_tbl_len", "pkey_tbl_len"),
            ("lid", "lid"),
            ("active_width", "active_width"),
            ("phys_state", "phys_state"),
            ("link_layer", "link_layer"),
            ("flags", "flags"),
            ("port_cap_flags2", "port_cap_flags2"),
        ],
    ),
    (
        "struct ibv_pd",
        "IbvPd",
        &[("context", "context"), ("handle", "handle")],
    ),
    (
        "struct ibv_mr",
        "IbvMr",
        &[
            ("pd", "pd"),
            ("addr", "addr"),
            ("length", "length"),
            ("lkey", "lkey"),
            ("rkey", "rkey"),
        ],
    ),
    (
        "struct ibv_comp_channel",
        "IbvCompChannel",
        &[("fd", "fd"), ("refcnt", "refcnt")],
    ),
    (
        "struct ibv_cq",
        "IbvCq",
        &[
            ("channel", "channel"),
            ("cq_context", "cq_context"),
            ("cqe", "cqe"),
            ("mutex", "mutex"),
            ("cond", "cond"),
            ("comp_events_completed", "comp_events_completed"),
        ],
    ),
    (
        "struct ibv_qp",
        "IbvQp",
        &[
            ("qp_context", "qp_context"),
            ("send_cq", "send_cq"),
            ("recv_cq", "recv_cq"),
            ("srq", "srq"),
            ("qp_num", "qp_num"),
            ("state", "state"),
            ("qp_type", "qp_type"),
            ("mutex", "mutex"),
            ("events_completed", "events_completed"),
        ],
    ),
    (
        "struct ibv_srq",
        "IbvSrq",
        &[
            ("srq_context", "srq_context"),
            ("pd", "pd"),
            ("handle", "handle"),
            ("mutex", "mutex"),
            ("cond", "cond"),
            ("events_completed", "events_completed"),
        ],
    ),
    (
        "struct ibv_srq_attr",
        "IbvSrqAttr",
        &[("max_sge", "max_sge"), ("srq_limit", "srq_limit")],
    ),
    (
        "struct ibv_srq_init_attr",
        "IbvSrqInitAttr",
        &[("attr", "attr"), ("attr.max_wr", "attr.max_wr")],
    ),
    (
        "struct ibv_qp_init_attr",
        "IbvQpInitAttr",
        &[
            ("srq", "srq"),
            ("cap.max_inline_data", "cap.max_inline_data"),
            ("qp_type", "qp_type"),
            ("sq_sig_all", "sq_sig_all"),
        ],
    ),
    (
        "struct ibv_qp_attr",
        "IbvQpAttr",
        &[
            ("qkey", "qkey"),
            ("dest_qp_num", "dest_qp_num"),
            ("qp_access_flags", "qp_access_flags"),
            ("cap", "cap"),
            ("ah_attr", "ah_attr"),
            ("ah_attr.dlid", "ah_attr.dlid"),
            ("ah_attr.is_global", "ah_attr.is_global"),
            ("ah_attr.port_num", "ah_attr.port_num"),
            ("alt_ah_attr", "alt_ah_attr"),
            ("pkey_index", "pkey_index"),
            ("max_rd_atomic", "max_rd_atomic"),
            ("min_rnr_timer", "min_rnr_timer"),
            ("rnr_retry", "rnr_retry"),
            ("rate_limit", "rate_limit"),
        ],
    ),
    (
        "struct ibv_ah",
        "IbvAh",
        &[("pd", "pd"), ("handle", "handle")],
    ),
    (
        "struct ibv_sge",
        "IbvSge",
        &[("addr", "addr"), ("length", "length"), ("lkey", "lkey")],
    ),
    (
        "struct ibv_send_wr",
        "IbvSendWr",
        &[
            ("next", "next"),
            ("sg_list", "sg_list"),
            ("num_sge", "num_sge"),
            ("opcode", "opcode"),
            ("send_flags", "send_flags"),
            ("imm_data", "imm_data"),
            ("wr.rdma.remote_addr", "wr.rdma.remote_addr"),
            ("wr.rdma.rkey", "wr.rdma.rkey"),
            ("wr.atomic.compare_add", "wr.atomic.compare_add"),
            ("wr.atomic.swap", "wr.atomic.swap"),
            ("wr.atomic.rkey", "wr.atomic.rkey"),
            ("wr.ud.ah", "wr.ud.ah"),
            ("wr.ud.remote_qpn", "wr.ud.remote_qpn"),
            ("wr.ud.remote_qkey", "wr.ud.remote_qkey"),
            ("qp_type", "qp_type"),
        ],
    ),
    (
        "struct ibv_recv_wr",
        "IbvRecvWr",
        &[
            ("next", "next"),
            ("sg_list", "sg_list"),
            ("num_sge", "num_sge"),
        ],
    ),
    (
        "struct ibv_wc",
        "IbvWc",
        &[
            ("status", "status"),
            ("opcode", "opcode"),
            ("byte_len", "byte_len"),
            ("imm_data", "imm_data"),
            ("qp_num", "qp_num"),
            ("src_qp", "src_qp"),
            ("wc_flags", "wc_flags"),
            ("pkey_index", "pkey_index"),
            ("slid", "slid"),
            ("sl", "sl"),
            ("dlid_path_bits", "dlid_path_bits"),
        ],
    ),
    (
        "struct ibv_gid_entry",
        "IbvGidEntry",
        &[
            ("gid", "gid"),
            ("gid_index", "gid_index"),
            ("port_num", "port_num"),
            ("gid_type", "gid_type"),
            ("ndev_ifindex", "ndev_ifindex"),
        ],
    ),
];

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let map = out.join("libibverbs.map");
    let mut s = String::new();
    for n in NODES {
        let _ = writeln!(s, "{n} {{ }};");
    }
    std::fs::write(&map, s).expect("write the version script");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=/usr/include/infiniband/verbs.h");
    std::fs::write(out.join("layout_checks.rs"), layout_checks(&out)).expect("write checks");
}

/// Compile-time assertions from the installed header, or none (with a warning) without it.
fn layout_checks(out: &std::path::Path) -> String {
    if !std::path::Path::new("/usr/include/infiniband/verbs.h").exists() {
        println!(
            "cargo:warning=<infiniband/verbs.h> is not installed (apt-get install libibverbs-dev): \
             the ABI layouts are not checked against it"
        );
        return String::new();
    }
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    for (cs, rs, fields) in LAYOUTS {
        let _ = writeln!(
            c,
            "  printf(\"const _: () = assert!(core::mem::size_of::<{rs}>() == %zu);\\n\", sizeof({cs}));"
        );
        for (cf, rf) in *fields {
            let _ = writeln!(
                c,
                "  printf(\"const _: () = assert!(core::mem::offset_of!({rs}, {rf}) == %zu);\\n\", offsetof({cs}, {cf}));"
            );
        }
    }
    c += "  return 0;\n}\n";
    let src = out.join("layout.c");
    let exe = out.join("layout");
    std::fs::write(&src, c).expect("write layout.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let ok = Command::new(&cc)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        panic!("cannot compile the layout check against <infiniband/verbs.h> with {cc}");
    }
    let o = Command::new(&exe).output().expect("run the layout check");
    String::from_utf8(o.stdout).expect("layout check output")
}
