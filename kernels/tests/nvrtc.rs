//! Every CUDA kernel compiles with NVRTC, for the architectures the backend targets, and defines
//! every function the backend launches. Needs only the NVRTC library, no GPU: CI installs it and
//! sets `LORAPLEX_REQUIRE_NVRTC=1`, so a kernel that does not compile fails the build there.

use loraplex_kernels::cuda::{compile, kernel_names};

fn nvrtc_or_skip() -> bool {
    if compile::nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var("LORAPLEX_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "LORAPLEX_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (is its folder on LD_LIBRARY_PATH?)"
    );
    eprintln!("skipped: libnvrtc cannot be loaded");
    false
}

#[test]
fn every_kernel_compiles_to_machine_code_without_spills() {
    if !nvrtc_or_skip() {
        return;
    }
    let version = compile::nvrtc_version().unwrap();
    eprintln!("NVRTC {}.{}", version.0, version.1);
    for arch in ["sm_80", "sm_90"] {
        for (name, body) in compile::SOURCES {
            let out = compile::compile(name, body, arch, false, true).unwrap_or_else(|e| panic!("{e}"));
            assert!(out.image.len() > 1000, "{name} for {arch}: {} bytes", out.image.len());
            // ptxas reports each kernel's registers and spills; local-memory spills would make a
            // memory-bound kernel pay twice.
            for line in out.log.lines().filter(|l| l.contains("spill")) {
                let spilled = line.split(',').any(|part| {
                    let part = part.trim();
                    (part.ends_with("bytes spill stores") || part.ends_with("bytes spill loads")) && !part.starts_with("0 ")
                });
                assert!(!spilled, "{name} for {arch} spills: {line}\n{}", out.log);
            }
            eprintln!("{name} {arch}: {} bytes of CUBIN", out.image.len());
        }
    }
}

#[test]
fn every_launched_kernel_is_defined() {
    if !nvrtc_or_skip() {
        return;
    }
    let mut ptx = std::collections::HashMap::new();
    for (name, body) in compile::SOURCES {
        let out = compile::compile(name, body, "sm_90", true, false).unwrap_or_else(|e| panic!("{e}"));
        ptx.insert(name, String::from_utf8(out.image).unwrap());
    }
    for (module, kernel) in kernel_names() {
        let text = &ptx[module];
        assert!(text.contains(&format!(".entry {kernel}(")), "{kernel} is not defined by {module}.cu");
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_reported_with_the_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let err = compile::compile("broken", "extern \"C\" __global__ void k() { undefined_thing(); }", "sm_90", false, false).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("broken does not compile") && msg.contains("undefined_thing"), "{msg}");
}
