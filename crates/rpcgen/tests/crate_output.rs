//! `generate_crate` and the build-script helper, without running cargo.

use remora_rpcgen::{CrateOptions, Generator, HEADER_PREFIX, generate_crate};

const SRC: &str =
    "#include \"inc.x\"\nprogram P { version V1 { int F(thing) = 1; } = 1; } = 0x20000001;\n";
const INC: &str = "struct thing { int a; };\n";

#[test]
fn writes_a_standalone_crate_and_overwrites_its_own_output() {
    let tmp = tempfile::tempdir().unwrap();
    let x = tmp.path().join("my_proto.x");
    std::fs::write(&x, SRC).unwrap();
    std::fs::write(tmp.path().join("inc.x"), INC).unwrap();
    let out = tmp.path().join("out");
    let report = generate_crate(&CrateOptions::new(&x, &out)).unwrap();
    assert_eq!(report.crate_name, "my-proto");
    assert_eq!(report.sources.len(), 2);
    let cargo = std::fs::read_to_string(out.join("Cargo.toml")).unwrap();
    assert!(cargo.contains("name = \"my-proto\""));
    assert!(cargo.contains("remora-xdr = { path = "));
    assert!(cargo.contains("crates/oncrpc\" }"));
    assert!(cargo.contains("\n[workspace]\n"));
    let lib = std::fs::read_to_string(out.join("src/lib.rs")).unwrap();
    assert!(lib.starts_with(&format!("{HEADER_PREFIX}my_proto.x. Do not edit.\n//! ")));
    assert!(lib.contains("V1Client"));
    // Our own output is overwritten.
    generate_crate(&CrateOptions::new(&x, &out).standalone(false)).unwrap();
    let cargo = std::fs::read_to_string(out.join("Cargo.toml")).unwrap();
    assert!(!cargo.contains("[workspace]"));
}

#[test]
fn refuses_foreign_directories_and_bad_runtimes() {
    let tmp = tempfile::tempdir().unwrap();
    let x = tmp.path().join("p.x");
    std::fs::write(&x, "const A = 1;\n").unwrap();
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir_all(foreign.join("src")).unwrap();
    std::fs::write(foreign.join("src/lib.rs"), "fn main() {}\n").unwrap();
    let e = generate_crate(&CrateOptions::new(&x, &foreign))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not produced by remora rpcgen"), "{e}");
    let e = generate_crate(&CrateOptions::new(&x, tmp.path().join("o")).runtime(tmp.path()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not contain crates/xdr/Cargo.toml"), "{e}");
    let e = generate_crate(&CrateOptions::new(&x, tmp.path().join("o")).crate_name("9bad"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("invalid crate name"), "{e}");
}

#[test]
fn build_script_helper_writes_stem_rs() {
    let tmp = tempfile::tempdir().unwrap();
    let x = tmp.path().join("gpu.x");
    std::fs::write(&x, SRC).unwrap();
    std::fs::write(tmp.path().join("inc.x"), INC).unwrap();
    let out = tempfile::tempdir().unwrap();
    let path = Generator::new().compile_to(&x, out.path()).unwrap();
    assert_eq!(path, out.path().join("gpu.rs"));
    let code = std::fs::read_to_string(path).unwrap();
    assert!(code.starts_with(HEADER_PREFIX));
    let g = Generator::new().generate(&x).unwrap();
    assert_eq!(g.sources, vec![x.clone(), tmp.path().join("inc.x")]);
}
