//! Which vector instructions the CPU kernels run with, chosen once at run time.
//!
//! Every kernel is written once, generic over [`Isa`] (pulp's portable [`Simd`] trait plus the
//! few operations it lacks), and compiled for each instruction set below. [`Path::run`] calls it
//! inside a function built with that set's target features, so one binary runs at full width on
//! AVX-512, AVX2 + FMA and NEON machines, and correctly (scalar) anywhere else.

use std::fmt;
use std::sync::OnceLock;

use pulp::{NullaryFnOnce, Scalar, Simd};

#[cfg(target_arch = "aarch64")]
use pulp::aarch64::Neon;
#[cfg(target_arch = "x86_64")]
use pulp::x86::{V3, V4};

/// What the generic kernels need beyond [`Simd`].
pub trait Isa: Simd {
    /// Name of the instruction set, as benchmarks print it.
    const NAME: &'static str;

    /// `F32_LANES` 16-bit values, zero-extended to 32-bit lanes in order (bf16 and f16 values
    /// are widened to f32 from these, see `simd`).
    ///
    /// # Safety
    /// `p` must be valid for `F32_LANES` reads.
    unsafe fn load_u16(self, p: *const u16) -> Self::u32s;

    /// Asks for the cache line at `p` to be brought into L2; never faults, may do nothing.
    fn prefetch_l2(self, p: *const u8);
}

impl Isa for Scalar {
    const NAME: &'static str = "scalar";

    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> u32 {
        // SAFETY: one readable value (the contract, with one lane).
        unsafe { *p as u32 }
    }

    #[inline(always)]
    fn prefetch_l2(self, _p: *const u8) {}
}

#[cfg(target_arch = "x86_64")]
impl Isa for V3 {
    const NAME: &'static str = "avx2+fma";

    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> Self::u32s {
        use std::arch::x86_64::*;
        // SAFETY: 8 values (16 bytes) are readable at `p`; AVX2 is enabled in every context this
        // is inlined into (the token `self` proves the CPU has it).
        unsafe { pulp::cast(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }

    #[inline(always)]
    fn prefetch_l2(self, p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Isa for V4 {
    const NAME: &'static str = "avx512";

    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> Self::u32s {
        use std::arch::x86_64::*;
        // SAFETY: 16 values (32 bytes) are readable at `p`; AVX-512F is enabled in every context
        // this is inlined into (the token `self` proves the CPU has it).
        unsafe { pulp::cast(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))) }
    }

    #[inline(always)]
    fn prefetch_l2(self, p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8) }
    }
}

#[cfg(target_arch = "aarch64")]
impl Isa for Neon {
    const NAME: &'static str = "neon";

    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16) -> Self::u32s {
        use std::arch::aarch64::*;
        // SAFETY: 4 values (8 bytes) are readable at `p`; NEON is enabled in every context this
        // is inlined into.
        unsafe { pulp::cast(vmovl_u16(vld1_u16(p))) }
    }

    #[inline(always)]
    fn prefetch_l2(self, _p: *const u8) {}
}

/// A kernel generic over the instruction set.
pub trait Kernel {
    type Output;
    fn run<S: Isa>(self, simd: S) -> Self::Output;
}

/// Runs a kernel under the target features of `S` (see [`Path::run`]).
struct Call<S, K>(S, K);

impl<S: Isa, K: Kernel> NullaryFnOnce for Call<S, K> {
    type Output = K::Output;

    #[inline(always)]
    fn call(self) -> K::Output {
        self.1.run(self.0)
    }
}

/// What [`Path`] tells of its instruction set, read from the `Isa` it dispatches to.
struct Facts;

struct IsaFacts {
    name: &'static str,
    lanes: usize,
    registers: usize,
}

impl Kernel for Facts {
    type Output = IsaFacts;

    fn run<S: Isa>(self, _: S) -> IsaFacts {
        IsaFacts { name: S::NAME, lanes: S::F32_LANES, registers: S::REGISTER_COUNT }
    }
}

/// An instruction set this CPU has, holding the proof that it has it.
#[derive(Clone, Copy)]
pub enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(V3),
    #[cfg(target_arch = "x86_64")]
    Avx512(V4),
    #[cfg(target_arch = "aarch64")]
    Neon(Neon),
}

impl fmt::Debug for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl PartialEq for Path {
    fn eq(&self, other: &Path) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

impl Eq for Path {}

impl Default for Path {
    fn default() -> Self {
        Path::detect()
    }
}

/// Environment variable naming the instruction set to use instead of the best one: `avx512`,
/// `avx2`, `neon` or `scalar`, to measure or test one path on a machine that has several.
pub const ISA_ENV: &str = "LORAPLEX_CPU_ISA";

impl Path {
    /// Every instruction set this CPU can run, widest first; the last is always `Scalar`.
    pub fn available() -> Vec<Path> {
        let mut paths = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            paths.extend(V4::try_new().map(Path::Avx512));
            paths.extend(V3::try_new().map(Path::Avx2));
        }
        #[cfg(target_arch = "aarch64")]
        paths.extend(Neon::try_new().map(Path::Neon));
        paths.push(Path::Scalar);
        paths
    }

    /// The path named `name` ([`Path::name`]), if this CPU has it.
    pub fn named(name: &str) -> Option<Path> {
        Path::available().into_iter().find(|p| p.name() == name || p.short_name() == name)
    }

    /// The widest path, or the one [`ISA_ENV`] names (an unknown or unavailable name is an
    /// error shown once, and the widest path is used). Decided once per process.
    pub fn detect() -> Path {
        static CHOSEN: OnceLock<Path> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Path::available()[0];
            match std::env::var(ISA_ENV) {
                Ok(name) if !name.is_empty() => Path::named(&name).unwrap_or_else(|| {
                    let names: Vec<_> = Path::available().iter().map(|p| p.short_name()).collect();
                    eprintln!("{ISA_ENV}={name}: not an instruction set this CPU runs ({}); using {}", names.join(", "), best.short_name());
                    best
                }),
                _ => best,
            }
        })
    }

    pub fn name(self) -> &'static str {
        self.run(Facts).name
    }

    /// The name [`ISA_ENV`] takes.
    pub fn short_name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Path::Avx2(_) => "avx2",
            other => other.name(),
        }
    }

    /// f32 lanes per register.
    pub fn lanes(self) -> usize {
        self.run(Facts).lanes
    }

    /// Vector registers of the path.
    pub fn registers(self) -> usize {
        self.run(Facts).registers
    }

    /// f32 lanes per register of the kernels [`Path::run_256`] runs.
    pub fn lanes_256(self) -> usize {
        self.run_256(Facts).lanes
    }

    /// Runs `kernel` with 256-bit vectors on AVX-512 (compiled with AVX-512's features, so with
    /// its 32 registers); as [`Path::run`] on every other path. For loops bound by how fast
    /// memory streams in, where Zen 4's 512-bit loads fall behind its 256-bit ones.
    #[inline]
    pub fn run_256<K: Kernel>(self, kernel: K) -> K::Output {
        match self {
            #[cfg(target_arch = "x86_64")]
            Path::Avx512(s) => s.vectorize(Call(*s, kernel)),
            other => other.run(kernel),
        }
    }

    /// Runs `kernel` compiled for this path.
    #[inline]
    pub fn run<K: Kernel>(self, kernel: K) -> K::Output {
        match self {
            Path::Scalar => kernel.run(Scalar),
            #[cfg(target_arch = "x86_64")]
            Path::Avx2(s) => s.vectorize(Call(s, kernel)),
            #[cfg(target_arch = "x86_64")]
            Path::Avx512(s) => s.vectorize(Call(s, kernel)),
            #[cfg(target_arch = "aarch64")]
            Path::Neon(s) => s.vectorize(Call(s, kernel)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Widen<'a>(&'a [u16]);
    impl Kernel for Widen<'_> {
        type Output = Vec<u32>;
        fn run<S: Isa>(self, s: S) -> Vec<u32> {
            let mut out = vec![0u32; self.0.len()];
            for (o, chunk) in out.chunks_exact_mut(S::F32_LANES).zip(self.0.chunks_exact(S::F32_LANES)) {
                // SAFETY: the chunk holds F32_LANES values.
                let v = unsafe { s.load_u16(chunk.as_ptr()) };
                s.partial_store_u32s(o, v);
            }
            out
        }
    }

    #[test]
    fn every_path_widens_16_bit_values_in_order() {
        let vals: Vec<u16> = (0..64u32).map(|i| (i * 1031 + 65000 * (i % 2)) as u16).collect();
        let want: Vec<u32> = vals.iter().map(|&v| v as u32).collect();
        let paths = Path::available();
        assert_eq!(paths.last(), Some(&Path::Scalar));
        // Every aarch64 CPU has NEON: its path must be found (and is what the tests cover there).
        #[cfg(target_arch = "aarch64")]
        assert!(matches!(paths[0], Path::Neon(_)), "{paths:?}");
        for path in paths {
            assert_eq!(path.run(Widen(&vals)), want, "{path:?}");
            assert_eq!(Path::named(path.short_name()), Some(path));
        }
    }
}
