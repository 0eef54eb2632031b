//! GPU-side checks of memory content: a hand-written PTX module, loaded through the driver
//! (`cuModuleLoadData`, JIT-compiled for whatever GPU runs it), with one kernel that fills a
//! buffer with a position-dependent pattern and one that counts the words that differ.
//!
//! The pattern is `word[i] = (i * 0x9E3779B1) ^ seed` (32-bit arithmetic), the same as
//! [`pattern_word`], so the host can check what a kernel wrote and the reverse.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use super::CudaError;
use super::context::{Ctx, CudaContext};
use super::stream::Stream;
use super::sys::{CUfunction, CUmodule};
use super::vmm::{AllocOptions, GpuMapping};

/// The PTX text of the pattern kernels (ISA 7.0, `sm_70`: the driver JIT-compiles it for
/// newer GPUs, Hopper included).
pub const PATTERN_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

// fill_u32(buf, words, seed): buf[i] = (i * 0x9E3779B1) ^ seed, grid-stride loop.
.visible .entry fill_u32(
    .param .u64 fill_buf,
    .param .u64 fill_words,
    .param .u32 fill_seed
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [fill_buf];
    ld.param.u64 %rd2, [fill_words];
    ld.param.u32 %r1, [fill_seed];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    cvt.u64.u32 %rd3, %r5;
    mov.u32 %r6, %nctaid.x;
    mul.lo.u32 %r6, %r6, %r3;
    cvt.u64.u32 %rd4, %r6;
FILL_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra FILL_DONE;
    cvt.u32.u64 %r7, %rd3;
    mul.lo.s32 %r7, %r7, -1640531535;
    xor.b32 %r7, %r7, %r1;
    shl.b64 %rd5, %rd3, 2;
    add.s64 %rd6, %rd1, %rd5;
    st.global.u32 [%rd6], %r7;
    add.s64 %rd3, %rd3, %rd4;
    bra.uni FILL_LOOP;
FILL_DONE:
    ret;
}

// verify_u32(buf, words, seed, errors): atomically counts the words that differ from the
// pattern into *errors.
.visible .entry verify_u32(
    .param .u64 verify_buf,
    .param .u64 verify_words,
    .param .u32 verify_seed,
    .param .u64 verify_errors
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [verify_buf];
    ld.param.u64 %rd2, [verify_words];
    ld.param.u32 %r1, [verify_seed];
    ld.param.u64 %rd7, [verify_errors];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd7, %rd7;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    cvt.u64.u32 %rd3, %r5;
    mov.u32 %r6, %nctaid.x;
    mul.lo.u32 %r6, %r6, %r3;
    cvt.u64.u32 %rd4, %r6;
VERIFY_LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra VERIFY_DONE;
    cvt.u32.u64 %r7, %rd3;
    mul.lo.s32 %r7, %r7, -1640531535;
    xor.b32 %r7, %r7, %r1;
    shl.b64 %rd5, %rd3, 2;
    add.s64 %rd6, %rd1, %rd5;
    ld.global.u32 %r8, [%rd6];
    setp.ne.u32 %p2, %r8, %r7;
    @%p2 atom.global.add.u32 %r9, [%rd7], 1;
    add.s64 %rd3, %rd3, %rd4;
    bra.uni VERIFY_LOOP;
VERIFY_DONE:
    ret;
}
"#;

/// Threads per block of the pattern kernels.
const BLOCK: u32 = 256;
/// Most blocks launched (the kernels loop over the rest).
const MAX_GRID: u32 = 4096;

/// The pattern word at index `i` for `seed` (what `fill_u32` writes).
pub fn pattern_word(i: u64, seed: u32) -> u32 {
    (i as u32).wrapping_mul(0x9E37_79B1) ^ seed
}

/// The parameter types of the `.entry` named `name` in a PTX text, in order
/// (`["u64", "u64", "u32"]`), or `None` when there is no such entry. Lets tests check the
/// launch code against the kernel text.
pub fn entry_params(ptx: &str, name: &str) -> Option<Vec<String>> {
    let start = ptx.find(&format!(".entry {name}("))?;
    let rest = &ptx[start..];
    let close = rest.find(')')?;
    let params = &rest[rest.find('(')? + 1..close];
    Some(
        params
            .split(',')
            .filter_map(|p| {
                let mut words = p.split_whitespace();
                (words.next()? == ".param").then_some(())?;
                words.next().map(|t| t.trim_start_matches('.').to_owned())
            })
            .collect(),
    )
}

/// Grid size for `words` 32-bit words.
fn grid_for(words: u64) -> u32 {
    u32::try_from(words.div_ceil(u64::from(BLOCK))).unwrap_or(MAX_GRID).clamp(1, MAX_GRID)
}

/// The loaded pattern module; unloaded on drop.
#[derive(Debug)]
pub struct Module {
    ctx: Arc<Ctx>,
    owner: CudaContext,
    raw: CUmodule,
    fill: CUfunction,
    verify: CUfunction,
}

// SAFETY: module and function handles may be used from any thread; every use binds the
// module's context first.
unsafe impl Send for Module {}

impl CudaContext {
    /// Loads [`PATTERN_PTX`] into this context (the driver JIT-compiles it).
    pub fn load_pattern_module(&self) -> Result<Module, CudaError> {
        self.bind()?;
        let drv = self.inner.drv;
        let text = CString::new(PATTERN_PTX).map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
        let raw = drv.module_load_data(&text)?;
        let lookup = |name: &str| {
            let c = CString::new(name).map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
            drv.module_function(raw, &c)
        };
        let functions = lookup("fill_u32").and_then(|f| Ok((f, lookup("verify_u32")?)));
        match functions {
            Ok((fill, verify)) => Ok(Module { ctx: self.inner.clone(), owner: self.clone(), raw, fill, verify }),
            Err(e) => {
                if let Err(u) = drv.module_unload(raw) {
                    tracing::warn!("cuModuleUnload: {u}");
                }
                Err(e)
            }
        }
    }
}

fn words_of(m: &GpuMapping<'_>) -> u64 {
    (m.len() / 4) as u64
}

impl Module {
    /// Fills `m` with the pattern for `seed` from the GPU, and waits.
    /// `m` must be accessible to the module's device ([`CudaError::NoAccess`]).
    pub fn fill(&self, stream: &Stream, m: &GpuMapping<'_>, seed: u32) -> Result<(), CudaError> {
        m.check_access(self.ctx.ordinal)?;
        let mut buf = m.device_ptr();
        let mut words = words_of(m);
        let mut seed = seed;
        let mut params = [(&raw mut buf).cast::<c_void>(), (&raw mut words).cast(), (&raw mut seed).cast()];
        self.ctx.bind()?;
        // SAFETY: `params` points at one live value per parameter of `fill_u32` with its
        // type (u64, u64, u32; `entry_params` tests hold the text to it); the kernel writes
        // only `words` 32-bit words from `buf`, all inside `m`, which stays mapped because
        // we wait for the stream before returning.
        unsafe { self.ctx.drv.launch(self.fill, grid_for(words), BLOCK, stream.raw, &mut params)? };
        stream.synchronize()
    }

    /// Counts, from the GPU, the 32-bit words of `m` that differ from the pattern for `seed`.
    /// `m` must be accessible to the module's device ([`CudaError::NoAccess`]).
    pub fn verify(&self, stream: &Stream, m: &GpuMapping<'_>, seed: u32) -> Result<u64, CudaError> {
        m.check_access(self.ctx.ordinal)?;
        // The counter lives in a small allocation of the module's own device.
        let counter_mem = self.owner.allocate(4, AllocOptions::default())?;
        let counter = counter_mem.map(&[])?;
        counter.write(0, &0u32.to_ne_bytes())?;
        let mut buf = m.device_ptr();
        let mut words = words_of(m);
        let mut seed = seed;
        let mut errors = counter.device_ptr();
        let mut params = [
            (&raw mut buf).cast::<c_void>(),
            (&raw mut words).cast(),
            (&raw mut seed).cast(),
            (&raw mut errors).cast(),
        ];
        self.ctx.bind()?;
        // SAFETY: `params` matches `verify_u32` (u64, u64, u32, u64); the kernel reads
        // `words` words inside `m` and adds to the one word at `errors` inside `counter`;
        // both stay mapped until the stream is synchronised below.
        unsafe { self.ctx.drv.launch(self.verify, grid_for(words), BLOCK, stream.raw, &mut params)? };
        stream.synchronize()?;
        let mut out = [0u8; 4];
        counter.read(0, &mut out)?;
        Ok(u64::from(u32::from_ne_bytes(out)))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let r = self.ctx.bind().and_then(|()| self.ctx.drv.module_unload(self.raw));
        if let Err(e) = r {
            tracing::warn!("unloading the pattern module: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_code_matches_the_kernel_signatures() {
        assert_eq!(entry_params(PATTERN_PTX, "fill_u32").unwrap(), ["u64", "u64", "u32"]);
        assert_eq!(entry_params(PATTERN_PTX, "verify_u32").unwrap(), ["u64", "u64", "u32", "u64"]);
        assert_eq!(entry_params(PATTERN_PTX, "nope"), None);
    }

    #[test]
    fn ptx_text_is_well_formed_enough_to_load() {
        // cuModuleLoadData needs a NUL-free text, a version and target line, and balanced
        // braces; each label that is branched to must be defined.
        assert!(!PATTERN_PTX.contains('\0'));
        assert!(PATTERN_PTX.contains(".version 7.0") && PATTERN_PTX.contains(".address_size 64"));
        assert_eq!(PATTERN_PTX.matches('{').count(), PATTERN_PTX.matches('}').count());
        let mut branches = 0;
        for line in PATTERN_PTX.lines() {
            let Some(target) = line.split("bra.uni ").nth(1).or_else(|| line.split("bra ").nth(1)) else { continue };
            let label = target.trim_end_matches(';').trim();
            assert!(PATTERN_PTX.contains(&format!("\n{label}:")), "label {label} undefined");
            branches += 1;
            // A predicated branch may diverge within a warp: `bra.uni` would promise it does not.
            if line.trim_start().starts_with('@') {
                assert!(!line.contains("bra.uni"), "divergent branch marked uniform: {line}");
            }
        }
        assert_eq!(branches, 4);
    }

    /// Assembles the PTX with NVIDIA's `ptxas` where one is installed (`FABRIC_PTXAS`, else
    /// `ptxas` on the PATH; it needs no GPU): the check the driver's JIT will make.
    #[test]
    fn ptx_assembles_with_ptxas_when_available() {
        let ptxas = std::env::var_os("FABRIC_PTXAS").unwrap_or_else(|| "ptxas".into());
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("pattern.ptx");
        std::fs::write(&src, PATTERN_PTX).unwrap();
        for arch in ["sm_70", "sm_90"] {
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg(&src)
                .arg("-o")
                .arg(dir.path().join(format!("{arch}.cubin")))
                .output();
            let Ok(out) = out else { return }; // no ptxas here
            assert!(out.status.success(), "ptxas {arch}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }

    #[test]
    fn host_pattern_matches_the_kernel_formula() {
        assert_eq!(pattern_word(0, 7), 7);
        assert_eq!(pattern_word(1, 0), 0x9E37_79B1);
        assert_eq!(pattern_word(2, 0), 0x9E37_79B1u32.wrapping_mul(2));
        // 32-bit index arithmetic, as in the kernel's cvt.u32.u64.
        assert_eq!(pattern_word(1 << 32, 5), 5);
    }

    #[test]
    fn grid_is_bounded() {
        assert_eq!(grid_for(0), 1);
        assert_eq!(grid_for(256), 1);
        assert_eq!(grid_for(257), 2);
        assert_eq!(grid_for(u64::MAX), MAX_GRID);
    }
}
