//! Run-time compilation of `kernels/cuda/*.cu` with NVRTC, straight to machine code (CUBIN) for
//! the device's architecture, cached on disk by a hash of everything that shapes the output.
//!
//! CUBIN rather than PTX: the driver then loads code compiled by any NVRTC of the same major
//! version, while PTX from a newer NVRTC than the driver is refused.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};

use crate::{KernelError, Result};

const COMMON: &str = include_str!("../../cuda/common.cuh");

/// The kernel sources: (module name, source). Each compiles on its own, with `common.cuh` first.
pub const SOURCES: [(&str, &str); 4] = [
    ("dense", include_str!("../../cuda/dense.cu")),
    ("attention", include_str!("../../cuda/attention.cu")),
    ("lora", include_str!("../../cuda/lora.cu")),
    ("sampling", include_str!("../../cuda/sampling.cu")),
];

/// The full text NVRTC compiles for a module.
pub fn module_source(body: &str) -> String {
    format!("{COMMON}\n{body}")
}

/// Whether the NVRTC library can be loaded (checked before any NVRTC call: a missing library
/// would otherwise panic inside the loader).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library; no NVRTC function is called.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version, (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(KernelError::Device { op: "nvrtc", detail: "the NVRTC library (libnvrtc) cannot be loaded".into() });
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the two out-pointers are valid for the call.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().map_err(|e| KernelError::Device { op: "nvrtc", detail: format!("nvrtcVersion: {e:?}") })?;
    Ok((major, minor))
}

/// What one compile produced.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The CUBIN (or PTX, when asked for) image.
    pub image: Vec<u8>,
    /// NVRTC's log: warnings, and with `verbose` the assembler's register and spill report.
    pub log: String,
}

/// Options for one architecture, e.g. `sm_90`.
fn options(arch: &str, ptx: bool, verbose: bool) -> Vec<String> {
    let mut opts = vec![
        if ptx { format!("--gpu-architecture=compute_{}", &arch[3..]) } else { format!("--gpu-architecture={arch}") },
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    if verbose && !ptx {
        opts.push("--ptxas-options=-v".to_string());
    }
    opts
}

/// Compiles one module for `arch` (`sm_XY`), to CUBIN, or to PTX with `ptx`.
pub fn compile(name: &str, body: &str, arch: &str, ptx: bool, verbose: bool) -> Result<Compiled> {
    const OP: &str = "nvrtc";
    if !arch.starts_with("sm_") || arch.len() < 5 || !arch[3..].chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(KernelError::Device { op: OP, detail: format!("`{arch}` is not an architecture like sm_90") });
    }
    if !nvrtc_present() {
        return Err(KernelError::Device { op: OP, detail: "the NVRTC library (libnvrtc) cannot be loaded".into() });
    }
    let err = |what: &str, e: result::NvrtcError| KernelError::Device { op: OP, detail: format!("{name}: {what}: {e:?}") };
    let src = CString::new(module_source(body)).map_err(|_| KernelError::Device { op: OP, detail: format!("{name}: source holds a NUL") })?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| KernelError::Device { op: OP, detail: "bad module name".into() })?;
    let prog = result::create_program(&src, Some(&cname)).map_err(|e| err("create", e))?;
    let opts = options(arch, ptx, verbose);
    // SAFETY: `prog` is a live program from create_program; it is destroyed exactly once below,
    // after the log and the image have been copied out.
    let outcome = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog).ok().map(|raw| CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned()).unwrap_or_default();
        let image = match compiled {
            Err(e) => Err(KernelError::Device { op: OP, detail: format!("{name} does not compile for {arch} ({e:?}):\n{log}") }),
            Ok(()) if ptx => {
                result::get_ptx(prog).map(|p| p.iter().take_while(|&&c| c != 0).map(|c| c.to_ne_bytes()[0]).collect::<Vec<u8>>()).map_err(|e| err("ptx", e))
            }
            Ok(()) => cubin(prog).map_err(|e| err("cubin", e)),
        };
        let destroyed = result::destroy_program(prog);
        (image, log, destroyed)
    };
    let (image, log, destroyed) = outcome;
    destroyed.map_err(|e| err("destroy", e))?;
    Ok(Compiled { image: image?, log })
}

/// Copies the CUBIN out of a compiled program.
///
/// # Safety
/// `prog` must be a successfully compiled, not yet destroyed program.
unsafe fn cubin(prog: sys::nvrtcProgram) -> std::result::Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: per this function's contract; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) }.result()?;
    Ok(buf)
}

/// Where compiled modules are kept: `LORAPLEX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/loraplex/kernels`,
/// else `~/.cache/loraplex/kernels`, else none.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LORAPLEX_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(base.join("loraplex").join("kernels"))
}

/// The cache file for a module: its name, the architecture, and a hash of the source, the
/// options and NVRTC's version.
pub fn cache_file(dir: &Path, name: &str, body: &str, arch: &str, nvrtc: (i32, i32)) -> PathBuf {
    let mut h = Sha256::new();
    h.update(module_source(body).as_bytes());
    for o in options(arch, false, false) {
        h.update(o.as_bytes());
        h.update([0]);
    }
    h.update(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{name}-{arch}-{hex}.cubin"))
}

/// The CUBIN of a module for `arch`, from the cache when there, else compiled and stored
/// (atomically: a half-written file is never read). A cache that cannot be written only costs a
/// recompile next time.
pub fn cubin_cached(dir: Option<&Path>, name: &str, body: &str, arch: &str) -> Result<Vec<u8>> {
    let version = nvrtc_version()?;
    let path = dir.map(|d| cache_file(d, name, body, arch, version));
    if let Some(path) = &path
        && let Ok(bytes) = std::fs::read(path)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let compiled = compile(name, body, arch, false, false)?;
    if let Some(path) = &path
        && let Some(parent) = path.parent()
        && std::fs::create_dir_all(parent).is_ok()
    {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &compiled.image).is_ok() && std::fs::rename(&tmp, path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(compiled.image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_files_change_with_source_arch_and_compiler() {
        let dir = Path::new("/c");
        let a = cache_file(dir, "lora", "x", "sm_90", (13, 0));
        assert_eq!(a, cache_file(dir, "lora", "x", "sm_90", (13, 0)));
        assert_ne!(a, cache_file(dir, "lora", "y", "sm_90", (13, 0)));
        assert_ne!(a, cache_file(dir, "lora", "x", "sm_80", (13, 0)));
        assert_ne!(a, cache_file(dir, "lora", "x", "sm_90", (13, 1)));
        assert!(a.file_name().unwrap().to_str().unwrap().starts_with("lora-sm_90-"));
    }

    #[test]
    fn options_name_the_architecture() {
        assert_eq!(options("sm_90", false, false)[0], "--gpu-architecture=sm_90");
        assert_eq!(options("sm_90", true, false)[0], "--gpu-architecture=compute_90");
        assert!(options("sm_90", false, true).iter().any(|o| o.contains("-v")));
    }

    #[test]
    fn bad_architectures_are_refused_before_loading_anything() {
        let err = compile("dense", SOURCES[0].1, "ninety", false, false).unwrap_err();
        assert!(err.to_string().contains("not an architecture"), "{err}");
    }
}
