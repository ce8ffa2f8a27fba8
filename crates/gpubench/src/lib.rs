//! The measuring side of `remora bench launch|copy`: one benchmark client. It loads a CUDA
//! driver library — the system's `libcuda.so.1` for the native baseline, or Remora's shim —
//! sets up a context, an empty kernel, a stream and buffers, says `READY` on stdout, waits for
//! `GO` on stdin (so that all clients of a group start together), measures, and prints one
//! JSON line ([`WorkerResult`]). A launch worker also stops between its burst and its launch +
//! synchronize loop (it says `SYNC` and waits for `GO` again, so that the clients' loops run
//! together and the parent can read the servers' CPU time around them) and, after its JSON
//! line, waits for its standard input to close before it exits (so that its session ends
//! after the parent's last reading). The orchestration lives in the `remora` command.

use std::ffi::{CString, OsString, c_char, c_int, c_uint, c_void};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

pub mod sched;

/// An empty kernel as PTX: the driver compiles it for whatever GPU it has.
const EMPTY_KERNEL_PTX: &str = "\
.version 8.0
.target sm_80
.address_size 64
.visible .entry remora_bench_empty()
{
	ret;
}
";
/// The kernel's name in [`EMPTY_KERNEL_PTX`].
const EMPTY_KERNEL: &str = "remora_bench_empty";

/// A kernel that keeps each of its blocks busy for a number of SM clock cycles (its one
/// parameter): the greedy tenant's work in `remora bench fairness`.
const SPIN_KERNEL_PTX: &str = "\
.version 8.0
.target sm_80
.address_size 64
.visible .entry remora_bench_spin(.param .u64 remora_bench_spin_cycles)
{
	.reg .pred %p<2>;
	.reg .b64 %rd<5>;
	ld.param.u64 %rd1, [remora_bench_spin_cycles];
	mov.u64 %rd2, %clock64;
$L_spin:
	mov.u64 %rd3, %clock64;
	sub.s64 %rd4, %rd3, %rd2;
	setp.lt.u64 %p1, %rd4, %rd1;
	@%p1 bra $L_spin;
	ret;
}
";
/// The kernel's name in [`SPIN_KERNEL_PTX`].
const SPIN_KERNEL: &str = "remora_bench_spin";

/// A kernel that stores to the address it is given: at a low address that no allocation
/// holds, an illegal-address fault (`bench fairness`'s faulting tenant).
const FAULT_KERNEL_PTX: &str = "\
.version 8.0
.target sm_80
.address_size 64
.visible .entry remora_bench_fault(.param .u64 remora_bench_fault_addr)
{
	.reg .b64 %rd<2>;
	.reg .b32 %r<2>;
	ld.param.u64 %rd1, [remora_bench_fault_addr];
	mov.u32 %r1, 1;
	st.global.u32 [%rd1], %r1;
	ret;
}
";
/// The kernel's name in [`FAULT_KERNEL_PTX`].
const FAULT_KERNEL: &str = "remora_bench_fault";
/// Threads per block of the spin kernel; two such blocks fill an SM of compute capability
/// 8.0 to 9.0 (2,048 resident threads).
const SPIN_BLOCK: c_uint = 1024;
/// Spin kernels launched between two events (the greedy client keeps two such batches
/// queued, so the GPU never waits for it).
const SPIN_BATCH: u32 = 8;

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum What {
    /// Empty-kernel launch throughput and launch + synchronize latency.
    Launch,
    /// Synchronous memcpy bandwidth, pinned and pageable, both directions.
    Copy,
    /// `bench fairness`'s greedy tenant: spin kernels that fill every SM, kept queued for
    /// `--millis`; kernels completed per second.
    Greedy,
    /// `bench fairness`'s latency-sensitive tenant: empty-kernel launch + synchronize for
    /// `--millis`; p50 and p99.
    Latency,
    /// `bench fairness`'s faulting tenant: after a third of `--millis`, a kernel that stores to
    /// an illegal address; the synchronize's error.
    Fault,
}

impl What {
    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            What::Launch => "launch",
            What::Copy => "copy",
            What::Greedy => "greedy",
            What::Latency => "latency",
            What::Fault => "fault",
        }
    }
}

/// One worker's result.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerResult {
    /// Microseconds per launch in a burst of asynchronous launches (then one synchronize).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_launch_us: Option<f64>,
    /// Launch + stream synchronize, p50 and p99 in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_p50_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_p99_us: Option<f64>,
    /// Launch + stream synchronize, the mean in microseconds: what a loop of round trips
    /// takes per trip, its rare long ones included (the p50 leaves them out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_mean_us: Option<f64>,
    /// CPU time of this whole process (every thread: the shim's too) per launch +
    /// synchronize, in microseconds: what waiting for the answers costs the client's cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_cpu_us: Option<f64>,
    /// Time this process's threads were runnable but waited for a core, per launch +
    /// synchronize, in microseconds (the second field of each thread's `/proc` `schedstat`):
    /// how much of a round trip under CPU contention is queueing for a core, which a spin
    /// that used up the thread's share makes longer on later wake-ups. None where `/proc`
    /// has no `schedstat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_runq_us: Option<f64>,
    /// Bandwidth by "pinned.htod", "pinned.dtoh", "pageable.htod", "pageable.dtoh" (GB/s,
    /// median over the repetitions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<(String, f64)>,
    /// Each timed phase as (name, start, end, amount): wall-clock nanoseconds since the Unix
    /// epoch, comparable between the workers of a group, and what the phase moved (bytes)
    /// or issued (launches). Aggregates over clients divide the summed amounts by the span
    /// from the first start to the last end, so clients that did not overlap are not
    /// counted as if they had.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spans: Vec<(String, u128, u128, f64)>,
    /// Spin kernels completed per second (`greedy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels_per_s: Option<f64>,
    /// Blocks per spin kernel (`greedy`): two per SM that the client sees. Under an MPS
    /// active thread percentage the driver reports only the client's share of the SMs, so
    /// the kernels shrink with it and GPU time is blocks, not kernels, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spin_blocks: Option<u32>,
    /// Launch + synchronize round trips made (`latency`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round_trips: Option<u64>,
    /// The CUDA error of the faulting kernel's synchronize (`fault`; 700 is an illegal
    /// address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_status: Option<i32>,
    /// With `--report-errors`: the error that ended the measurement early (what it measured
    /// until then is reported beside it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The GPU's name as the loaded driver reports it (`cuDeviceGetName`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub device: String,
}

/// Wall-clock nanoseconds since the Unix epoch.
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

// Loading the driver ------------------------------------------------------------------------------------

type Res = c_int;
type Ptr = *mut c_void;

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;

/// `cuLaunchKernel`.
type LaunchFn = unsafe extern "C" fn(
    Ptr,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Ptr,
    *mut Ptr,
    *mut Ptr,
) -> Res;

/// Declares [`Api`], one field per entry point with the C prototype of its cuda.h 13.0
/// symbol, and `Api::resolve`, which looks every symbol up in the loaded library.
macro_rules! driver_api {
    ($($field:ident = $sym:literal: $ty:ty;)*) => {
        /// The driver entry points a worker uses, from the library it loaded.
        struct Api {
            _lib: libloading::Library,
            $($field: $ty,)*
        }

        impl Api {
            /// The entry points of `lib`, loaded from `name`.
            fn resolve(lib: libloading::Library, name: &std::ffi::OsStr) -> Result<Self> {
                Ok(Self {
                    $($field: {
                        // SAFETY: the symbol is the cuda.h 13.0 entry point of that name,
                        // whose C prototype is the field's type.
                        *unsafe { lib.get::<$ty>($sym) }.with_context(|| {
                            format!(
                                "{} lacks {}",
                                name.to_string_lossy(),
                                String::from_utf8_lossy($sym)
                            )
                        })?
                    },)*
                    _lib: lib,
                })
            }
        }
    };
}

driver_api! {
    init = b"cuInit": unsafe extern "C" fn(c_uint) -> Res;
    device_get = b"cuDeviceGet": unsafe extern "C" fn(*mut c_int, c_int) -> Res;
    device_get_name = b"cuDeviceGetName": unsafe extern "C" fn(*mut c_char, c_int, c_int) -> Res;
    device_get_attribute =
        b"cuDeviceGetAttribute": unsafe extern "C" fn(*mut c_int, c_int, c_int) -> Res;
    event_create = b"cuEventCreate": unsafe extern "C" fn(*mut Ptr, c_uint) -> Res;
    event_record = b"cuEventRecord": unsafe extern "C" fn(Ptr, Ptr) -> Res;
    event_synchronize = b"cuEventSynchronize": unsafe extern "C" fn(Ptr) -> Res;
    ctx_create = b"cuCtxCreate_v2": unsafe extern "C" fn(*mut Ptr, c_uint, c_int) -> Res;
    module_load_data = b"cuModuleLoadData": unsafe extern "C" fn(*mut Ptr, *const c_void) -> Res;
    module_get_function =
        b"cuModuleGetFunction": unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> Res;
    stream_create = b"cuStreamCreate": unsafe extern "C" fn(*mut Ptr, c_uint) -> Res;
    stream_synchronize = b"cuStreamSynchronize": unsafe extern "C" fn(Ptr) -> Res;
    launch = b"cuLaunchKernel": LaunchFn;
    mem_alloc = b"cuMemAlloc_v2": unsafe extern "C" fn(*mut u64, usize) -> Res;
    mem_alloc_host = b"cuMemAllocHost_v2": unsafe extern "C" fn(*mut Ptr, usize) -> Res;
    memcpy_htod = b"cuMemcpyHtoD_v2": unsafe extern "C" fn(u64, *const c_void, usize) -> Res;
    memcpy_dtoh = b"cuMemcpyDtoH_v2": unsafe extern "C" fn(Ptr, u64, usize) -> Res;
}

fn check(what: &str, rc: Res) -> Result<()> {
    if rc != 0 {
        bail!("{what} failed with CUDA error {rc}");
    }
    Ok(())
}

impl Api {
    /// Loads `path`, or for the native baseline the system's `libcuda.so.1`, refusing
    /// Remora's shim there.
    fn load(path: Option<&Path>) -> Result<Self> {
        let name: OsString = path.map_or_else(|| "libcuda.so.1".into(), |p| p.as_os_str().into());
        // SAFETY: loading a CUDA driver library runs its initializers, which is what using
        // CUDA means; nothing else is loaded.
        let lib = unsafe { libloading::Library::new(&name) }.with_context(|| {
            format!(
                "cannot load {} (is a CUDA driver installed?)",
                name.to_string_lossy()
            )
        })?;
        // SAFETY: looking a symbol up does not call it.
        let is_shim = unsafe { lib.get::<*const u32>(b"remora_shim_marker") }.is_ok();
        if path.is_none() && is_shim {
            bail!(
                "the libcuda.so.1 found for the native baseline is Remora's shim (LD_LIBRARY_PATH?); run remora bench outside `remora run`"
            );
        }
        if path.is_some() && !is_shim {
            bail!("{} is not Remora's shim", name.to_string_lossy());
        }
        Self::resolve(lib, &name)
    }
}

/// Worker options.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub what: What,
    pub driver: Option<PathBuf>,
    pub workload: Workload,
    pub fair: FairWorkload,
}

/// What a `bench fairness` client does (`greedy`, `latency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct FairWorkload {
    /// How long the client measures, in milliseconds.
    #[arg(long, default_value_t = 3_000)]
    pub millis: u32,
    /// SM clock cycles each block of the greedy client's kernel spins for.
    #[arg(long, default_value_t = 200_000)]
    pub spin_cycles: u64,
    /// A CUDA error during the measurement is reported in the result (with what was measured
    /// until then) instead of failing the worker: for clients beside a faulting one (set by
    /// `bench fairness --fault` for its workers).
    #[arg(long, hide = true)]
    pub report_errors: bool,
}

impl Default for FairWorkload {
    fn default() -> Self {
        Self {
            millis: 3_000,
            spin_cycles: 200_000,
            report_errors: false,
        }
    }
}

impl FairWorkload {
    /// The command-line options that give a worker this workload.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--millis".into(),
            self.millis.to_string(),
            "--spin-cycles".into(),
            self.spin_cycles.to_string(),
        ];
        if self.report_errors {
            args.push("--report-errors".into());
        }
        args
    }
}

/// How much each client measures: the options of `remora bench launch|copy`, passed on to
/// each worker as the same options, and recorded in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct Workload {
    /// Launches per client in the throughput burst (bench launch).
    #[arg(long, default_value_t = 20_000)]
    pub launches: u32,
    /// Launch + synchronize round trips per client (bench launch).
    #[arg(long, default_value_t = 2_000)]
    pub syncs: u32,
    /// Bytes per copy (bench copy).
    #[arg(long, default_value_t = 64 << 20)]
    pub bytes: u64,
    /// Timed copies per kind (bench copy); the median counts.
    #[arg(long, default_value_t = 10)]
    pub reps: u32,
    /// Every Nth launch + synchronize launches a long kernel instead of the empty one (bench
    /// launch; 0: never): one block spinning `--long-cycles` SM clock cycles, so that the
    /// waits alternate between short and long ones, as a program's do whose kernels differ
    /// between its synchronizes.
    #[arg(long, default_value_t = 0, value_name = "N")]
    #[serde(default)]
    pub long_every: u32,
    /// SM clock cycles the long kernel of `--long-every` spins (2,000,000: about 1 ms at
    /// 2 GHz).
    #[arg(long, default_value_t = LONG_CYCLES, value_name = "CYCLES")]
    #[serde(default = "long_cycles")]
    pub long_cycles: u64,
}

/// `--long-cycles`' default.
pub const LONG_CYCLES: u64 = 2_000_000;

fn long_cycles() -> u64 {
    LONG_CYCLES
}

impl Default for Workload {
    /// The command line's defaults.
    fn default() -> Self {
        Self {
            launches: 20_000,
            syncs: 2_000,
            bytes: 64 << 20,
            reps: 10,
            long_every: 0,
            long_cycles: LONG_CYCLES,
        }
    }
}

impl Workload {
    /// The command-line options that give a worker this workload.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--launches".into(),
            self.launches.to_string(),
            "--syncs".into(),
            self.syncs.to_string(),
            "--bytes".into(),
            self.bytes.to_string(),
            "--reps".into(),
            self.reps.to_string(),
            "--long-every".into(),
            self.long_every.to_string(),
            "--long-cycles".into(),
            self.long_cycles.to_string(),
        ]
    }
}

/// The median of `values` in any order: the middle value, or the mean of the two middle
/// ones (NaN when empty). The benchmarks' figures over rounds: with two rounds it is their
/// mean, not the larger one.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * q) as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// The worker: set up, READY, wait for GO, measure, print the JSON result.
pub fn worker(o: &WorkerOptions) -> Result<()> {
    let api = Api::load(o.driver.as_deref())?;
    let bytes = usize::try_from(o.workload.bytes).context("--bytes too large")?;
    // SAFETY: each call follows its cuda.h contract: outputs point to locals, the PTX image is
    // NUL-terminated, launches pass no parameters to a kernel that takes none, host buffers
    // span `bytes` and device buffers were allocated with `bytes`.
    unsafe {
        check("cuInit", (api.init)(0))?;
        let mut dev = 0;
        check("cuDeviceGet", (api.device_get)(&mut dev, 0))?;
        let mut ctx = std::ptr::null_mut();
        check("cuCtxCreate", (api.ctx_create)(&mut ctx, 0, dev))?;
        // The launch benchmark's kernel (REMORA_BENCH_IMAGE/REMORA_BENCH_KERNEL replace it, for
        // tests against the emulated backend).
        let mut f = std::ptr::null_mut();
        let mut spin = std::ptr::null_mut();
        let long = o.what == What::Launch && o.workload.long_every > 0;
        if o.what == What::Greedy || long {
            let image = CString::new(SPIN_KERNEL_PTX)?;
            let mut module = std::ptr::null_mut();
            check(
                "cuModuleLoadData (the spin kernel)",
                (api.module_load_data)(&mut module, image.as_ptr().cast()),
            )?;
            let name = CString::new(SPIN_KERNEL)?;
            check(
                "cuModuleGetFunction (the spin kernel)",
                (api.module_get_function)(&mut spin, module, name.as_ptr()),
            )?;
        }
        let mut fault = std::ptr::null_mut();
        if o.what == What::Fault {
            let image = CString::new(FAULT_KERNEL_PTX)?;
            let mut module = std::ptr::null_mut();
            check(
                "cuModuleLoadData (the fault kernel)",
                (api.module_load_data)(&mut module, image.as_ptr().cast()),
            )?;
            let name = CString::new(FAULT_KERNEL)?;
            check(
                "cuModuleGetFunction",
                (api.module_get_function)(&mut fault, module, name.as_ptr()),
            )?;
        }
        if matches!(o.what, What::Launch | What::Latency) {
            let image =
                std::env::var("REMORA_BENCH_IMAGE").unwrap_or_else(|_| EMPTY_KERNEL_PTX.into());
            let image = CString::new(image).context("REMORA_BENCH_IMAGE holds a NUL")?;
            let mut module = std::ptr::null_mut();
            check(
                "cuModuleLoadData (the empty kernel)",
                (api.module_load_data)(&mut module, image.as_ptr().cast()),
            )?;
            let name = CString::new(
                std::env::var("REMORA_BENCH_KERNEL").unwrap_or_else(|_| EMPTY_KERNEL.into()),
            )?;
            check(
                "cuModuleGetFunction",
                (api.module_get_function)(&mut f, module, name.as_ptr()),
            )?;
        }
        let mut stream = std::ptr::null_mut();
        check("cuStreamCreate", (api.stream_create)(&mut stream, 1))?;
        let launch = || {
            (api.launch)(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        let mut buffers = None;
        if o.what == What::Copy {
            let mut d = 0u64;
            check("cuMemAlloc", (api.mem_alloc)(&mut d, bytes))?;
            let mut pinned = std::ptr::null_mut();
            check("cuMemAllocHost", (api.mem_alloc_host)(&mut pinned, bytes))?;
            std::ptr::write_bytes(pinned.cast::<u8>(), 0x5a, bytes);
            buffers = Some((d, pinned, vec![0xa5u8; bytes]));
        }
        // The greedy client's kernel: two blocks per SM, each spinning `spin_cycles`.
        let mut sms: c_int = 0;
        check(
            "cuDeviceGetAttribute (multiprocessors)",
            (api.device_get_attribute)(&mut sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
        )?;
        let mut cycles = o.fair.spin_cycles;
        let mut spin_params = [(&raw mut cycles).cast::<c_void>()];
        let spin_grid = 2 * sms.max(1) as c_uint;
        // The spin kernel in `grid` blocks: the greedy client's fill every SM, the long
        // kernel of `--long-every` is one block.
        let launch_spin = |grid: c_uint, params: *mut Ptr| {
            (api.launch)(
                spin,
                grid,
                1,
                1,
                SPIN_BLOCK,
                1,
                1,
                0,
                stream,
                params,
                std::ptr::null_mut(),
            )
        };
        let mut events = [std::ptr::null_mut(); 2];
        if o.what == What::Greedy {
            for e in &mut events {
                check("cuEventCreate", (api.event_create)(e, 0))?;
            }
            check(
                "cuLaunchKernel (spin)",
                launch_spin(spin_grid, spin_params.as_mut_ptr()),
            )?;
            check("cuStreamSynchronize", (api.stream_synchronize)(stream))?;
        }
        // Warm up (JIT, first launches) before READY; copies warm up per kind below.
        if matches!(o.what, What::Launch | What::Latency) {
            for _ in 0..100 {
                check("cuLaunchKernel", launch())?;
            }
            check("cuStreamSynchronize", (api.stream_synchronize)(stream))?;
        }
        println!("READY");
        std::io::stdout().flush()?;
        let mut go = String::new();
        std::io::stdin().read_line(&mut go)?;
        if go.trim() != "GO" {
            bail!("expected GO from the parent");
        }
        let mut r = WorkerResult::default();
        let mut name = [0 as c_char; 256];
        if (api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev) == 0 {
            r.device = std::ffi::CStr::from_ptr(name.as_ptr())
                .to_string_lossy()
                .into_owned();
        }
        match o.what {
            What::Launch => {
                let (t0, w0) = (Instant::now(), now_ns());
                for _ in 0..o.workload.launches {
                    check("cuLaunchKernel", launch())?;
                }
                check("cuStreamSynchronize", (api.stream_synchronize)(stream))?;
                r.spans.push((
                    "launch".into(),
                    w0,
                    now_ns(),
                    f64::from(o.workload.launches),
                ));
                r.per_launch_us =
                    Some(t0.elapsed().as_secs_f64() * 1e6 / f64::from(o.workload.launches.max(1)));
                println!("SYNC");
                std::io::stdout().flush()?;
                go.clear();
                std::io::stdin().read_line(&mut go)?;
                if go.trim() != "GO" {
                    bail!("expected GO from the parent before the launch + synchronize loop");
                }
                let mut lat = Vec::with_capacity(o.workload.syncs as usize);
                let cpu = || {
                    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
                    t.tv_sec as f64 * 1e6 + t.tv_nsec as f64 / 1e3
                };
                // The long kernel (`--long-every`): one block spinning `--long-cycles`.
                let mut long_cycles = o.workload.long_cycles;
                let mut long_params = [(&raw mut long_cycles).cast::<c_void>()];
                let every = o.workload.long_every;
                let cpu0 = cpu();
                let runq0 = sched::TaskSched::of_process(std::process::id());
                for i in 0..o.workload.syncs {
                    let t = Instant::now();
                    if every > 0 && i % every == every - 1 {
                        check(
                            "cuLaunchKernel (the long kernel)",
                            launch_spin(1, long_params.as_mut_ptr()),
                        )?;
                    } else {
                        check("cuLaunchKernel", launch())?;
                    }
                    check("cuStreamSynchronize", (api.stream_synchronize)(stream))?;
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                if o.workload.syncs > 0 {
                    r.sync_cpu_us = Some((cpu() - cpu0) / f64::from(o.workload.syncs));
                    r.sync_runq_us = runq0
                        .zip(sched::TaskSched::of_process(std::process::id()))
                        .map(|(a, b)| {
                            b.since(&a).waiting as f64 / 1e3 / f64::from(o.workload.syncs)
                        });
                    r.sync_mean_us = Some(lat.iter().sum::<f64>() / lat.len() as f64);
                }
                lat.sort_by(f64::total_cmp);
                r.sync_p50_us = Some(percentile(&lat, 0.5));
                r.sync_p99_us = Some(percentile(&lat, 0.99));
            }
            What::Greedy => {
                // Two batches queued at all times: wait for the older one, queue the next.
                let millis = u128::from(o.fair.millis);
                let (t0, w0) = (Instant::now(), now_ns());
                let mut launched = 0u64;
                let mut batch = 0usize;
                let mut run = || -> Result<()> {
                    loop {
                        if batch >= 2 {
                            check(
                                "cuEventSynchronize",
                                (api.event_synchronize)(events[batch % 2]),
                            )?;
                            if t0.elapsed().as_millis() >= millis {
                                break;
                            }
                        }
                        for _ in 0..SPIN_BATCH {
                            check(
                                "cuLaunchKernel (spin)",
                                launch_spin(spin_grid, spin_params.as_mut_ptr()),
                            )?;
                        }
                        launched += u64::from(SPIN_BATCH);
                        check(
                            "cuEventRecord",
                            (api.event_record)(events[batch % 2], stream),
                        )?;
                        batch += 1;
                    }
                    check("cuStreamSynchronize", (api.stream_synchronize)(stream))
                };
                match run() {
                    Ok(()) => {}
                    Err(e) if o.fair.report_errors => r.error = Some(format!("{e:#}")),
                    Err(e) => return Err(e),
                }
                let secs = t0.elapsed().as_secs_f64();
                r.spans
                    .push(("greedy".into(), w0, now_ns(), launched as f64));
                r.kernels_per_s = Some(launched as f64 / secs);
                r.spin_blocks = Some(spin_grid);
            }
            What::Fault => {
                std::thread::sleep(std::time::Duration::from_millis(u64::from(
                    o.fair.millis / 3,
                )));
                let mut addr: u64 = 8;
                let mut params = [(&raw mut addr).cast::<c_void>()];
                let launched = (api.launch)(
                    fault,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                );
                r.fault_status = Some(if launched != 0 {
                    launched
                } else {
                    (api.stream_synchronize)(stream)
                });
            }
            What::Latency => {
                let millis = u128::from(o.fair.millis);
                let t0 = Instant::now();
                let w0 = now_ns();
                let mut lat = Vec::new();
                while t0.elapsed().as_millis() < millis {
                    let t = Instant::now();
                    check("cuLaunchKernel", launch())?;
                    check("cuStreamSynchronize", (api.stream_synchronize)(stream))?;
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                r.spans
                    .push(("latency".into(), w0, now_ns(), lat.len() as f64));
                r.round_trips = Some(lat.len() as u64);
                lat.sort_by(f64::total_cmp);
                r.sync_p50_us = Some(percentile(&lat, 0.5));
                r.sync_p99_us = Some(percentile(&lat, 0.99));
            }
            What::Copy => {
                let Some((d, pinned, mut pageable)) = buffers else {
                    bail!("no buffers");
                };
                let host: [(&str, Ptr); 2] = [
                    ("pinned", pinned),
                    ("pageable", pageable.as_mut_ptr().cast()),
                ];
                for (mem, h) in host {
                    for dir in ["htod", "dtoh"] {
                        let copy = || match dir {
                            "htod" => (api.memcpy_htod)(d, h, bytes),
                            _ => (api.memcpy_dtoh)(h, d, bytes),
                        };
                        check("warm-up copy", copy())?;
                        let mut gbps = Vec::new();
                        let w0 = now_ns();
                        for _ in 0..o.workload.reps.max(1) {
                            let t = Instant::now();
                            check("cuMemcpy", copy())?;
                            gbps.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
                        }
                        r.spans.push((
                            format!("{mem}.{dir}"),
                            w0,
                            now_ns(),
                            bytes as f64 * f64::from(o.workload.reps.max(1)),
                        ));
                        gbps.sort_by(f64::total_cmp);
                        r.copies
                            .push((format!("{mem}.{dir}"), percentile(&gbps, 0.5)));
                    }
                }
            }
        }
        println!("{}", serde_json::to_string(&r)?);
        std::io::stdout().flush()?;
        if o.what == What::Launch {
            // Until the parent closes our standard input: its last reading of the servers'
            // CPU time comes before this session ends.
            let mut rest = String::new();
            while std::io::stdin().read_line(&mut rest)? > 0 {
                rest.clear();
            }
        }
    }
    // Leave without tearing CUDA down: process exit frees everything, and the measurement is
    // already printed.
    std::process::exit(0);
}

#[cfg(test)]
mod tests {
    use super::{Workload, median};

    /// `Workload::default` is what the command line gives without options, and a report
    /// written before `--long-every` reads as without it.
    #[test]
    fn the_default_workload_is_the_command_lines() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            w: Workload,
        }
        let parsed = <Cli as clap::Parser>::try_parse_from(["bench"]).unwrap();
        assert_eq!(parsed.w, Workload::default());
        let old: Workload =
            serde_json::from_str(r#"{"launches":1,"syncs":2,"bytes":3,"reps":4}"#).unwrap();
        assert_eq!((old.long_every, old.long_cycles), (0, super::LONG_CYCLES));
        let args = Workload {
            long_every: 4,
            ..Workload::default()
        }
        .to_args();
        let mut with = vec!["bench".to_string()];
        with.extend(args);
        let round = <Cli as clap::Parser>::try_parse_from(with).unwrap();
        assert_eq!(round.w.long_every, 4);
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[10.2, 9.8]), 10.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }
}
