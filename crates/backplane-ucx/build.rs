//! Compiles `src/shim.c` against Debian's `libucx-dev` (UCX 1.13; `scripts/setup.sh` installs
//! it) and links UCP. The shim is the only code that sees UCP's structures, so their layouts
//! come from the installed header and cannot drift from the library.

fn main() {
    println!("cargo:rerun-if-changed=src/shim.c");
    if !std::path::Path::new("/usr/include/ucp/api/ucp.h").exists() {
        panic!(
            "backplane-ucx needs UCX's headers (<ucp/api/ucp.h>): install libucx-dev \
             (scripts/setup.sh does)"
        );
    }
    cc::Build::new()
        .file("src/shim.c")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .extra_warnings(true)
        .compile("bpucxshim");
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");
}
