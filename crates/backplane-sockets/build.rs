//! Compiles `src/execl.c`: the variadic exec calls, which Rust cannot define.

fn main() {
    println!("cargo:rerun-if-changed=src/execl.c");
    cc::Build::new()
        .file("src/execl.c")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .compile("bpexecl");
}
