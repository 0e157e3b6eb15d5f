//! A device's calibration constants: what one rank's kernels sustain, measured once per
//! device by `vae-parallel calibrate` and kept as a small TOML file.
//!
//! A CPU profile's rates are per thread, scaled by the threads a rank gets. A GPU profile
//! describes one whole GPU (one "core" of one "thread"): ranks that share it divide it, and
//! every launch also pays a fixed cost, which on a GPU decides how fast small maps run.

use serde::{Deserialize, Serialize};

fn one() -> usize {
    1
}

/// What kind of device a profile describes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CPU cores: rates per thread; shard convolutions overlap their halo exchange with the
    /// interior's compute.
    #[default]
    Cpu,
    /// One CUDA GPU: rates of the whole device; halos are exchanged before each convolution.
    Cuda,
}

/// The sustained rate of one convolution shape on one thread (one GPU).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConvRate {
    /// Kernel extent along frames, rows and columns.
    pub kernel: [usize; 3],
    /// Its alignment class (1 direct, 2 and 4 Winograd; see
    /// [`StepKind::Conv`](super::StepKind::Conv)).
    #[serde(default = "one")]
    pub align: usize,
    /// Channels read.
    pub in_channels: usize,
    /// Channels written.
    pub out_channels: usize,
    /// Multiply-adds per second, in billions, on one thread.
    pub gmacs: f64,
    /// A call's fixed cost beyond its multiply-adds, microseconds: on a CPU packing or
    /// transforming the weights (one thread), on a GPU its launches and the rate lost on a map
    /// too small to fill the device. 0 where it was not measured (the built-in constants).
    #[serde(default)]
    pub call_us: f64,
    /// One call's seconds on one thread at several map sizes, `[output positions, seconds]`
    /// by increasing positions (frames × rows × columns of the output, one output frame).
    /// Where given, a call's time is read from it (see [`DeviceProfile::conv_call_s`]) rather
    /// than from `gmacs` and `call_us`: a CPU convolution's rate changes with its map (it
    /// rises while the fixed work is amortised, and levels off or dips on the largest maps),
    /// which one line through two sizes does not follow.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub times: Vec<[f64; 2]>,
}

impl ConvRate {
    /// The seconds of one call producing `positions` output positions, by the measured times:
    /// linear between two measured sizes; below the smallest along the line through the two
    /// smallest (no faster than the smallest map's rate); above the largest at the largest
    /// map's average rate. None with fewer than two times.
    fn time_at(&self, positions: f64) -> Option<f64> {
        let [first, second] = [self.times.first()?, self.times.get(1)?];
        let slope = |[x0, y0]: [f64; 2], [x1, y1]: [f64; 2]| ((y1 - y0) / (x1 - x0)).max(0.0);
        if positions <= first[0] {
            let line = first[1] - (first[0] - positions) * slope(*first, *second);
            return Some(line.max(first[1] * positions / first[0]));
        }
        for pair in self.times.windows(2) {
            let ([x0, y0], [x1, y1]) = (pair[0], pair[1]);
            if positions <= x1 {
                return Some(y0 + (positions - x0) * (y1 - y0) / (x1 - x0));
            }
        }
        let [x, y] = *self.times.last()?;
        Some(y * positions / x)
    }
}

fn f32_name() -> String {
    "f32".into()
}

/// One device's constants. Rates are per thread; [`DeviceProfile::speedup`] scales them to the
/// threads a rank really gets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    /// The device, in words (CPU model and the SIMD features it was measured with, or the
    /// GPU's name).
    pub device: String,
    /// CPU cores or one GPU (profiles written before GPUs were calibrated are CPU ones).
    #[serde(default)]
    pub kind: DeviceKind,
    /// The element type the rates were measured in (`f32`, `bf16`, `tf32`).
    #[serde(default = "f32_name")]
    pub dtype: String,
    /// Where the constants come from (a calibration's date, or the built-in defaults).
    pub source: String,
    /// Cores the ranks of one host share (a GPU profile: 1, the GPU).
    pub cores: usize,
    /// Threads the multi-thread measurement used.
    pub threads: usize,
    /// `e` in `speedup(t) = 1 + (t − 1)·e`: the share of each extra thread (each extra busy
    /// core, whichever rank runs on it) that turns into speed; measured on a 2-D convolution.
    pub thread_efficiency: f64,
    /// The same for 3-D convolutions (the video VAEs'); `thread_efficiency` where not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_efficiency_3d: Option<f64>,
    /// Measured convolution shapes.
    pub convs: Vec<ConvRate>,
    /// Norms, SiLU, additions and copies: bytes read plus written per second, in billions, on
    /// one thread.
    pub elementwise_gbps: f64,
    /// Attention: multiply-adds per second, in billions, on one thread.
    pub attention_gmacs: f64,
    /// The fixed cost of one norm, element-wise pass or attention call, microseconds (a GPU's
    /// launches; 0 on CPU profiles).
    #[serde(default)]
    pub op_call_us: f64,
    /// One message's fixed cost between ranks, microseconds.
    pub link_latency_us: f64,
    /// Bytes per second between two ranks, in billions.
    pub link_gbps: f64,
    /// Scratch a convolution holds beyond its output and what the model counts for its kernel,
    /// bytes, as the rank's account sees it. On a CPU, the model counts the packed or
    /// transformed weights and the working buffers ([`kernels`](super::kernels)), so this is the
    /// rest (a few row buffers); on a GPU, the weights in the element type and a padded copy of
    /// the input. (CPU profiles calibrated before the model counted the kernels' buffers hold
    /// about 7 MiB here, a Winograd band's buffers counted twice now: calibrate again.)
    pub conv_scratch_bytes: u64,
    /// A GPU's per-layer convolution choices (`VAE_CUDA_CONV=fastest`: our kernels or one of
    /// cuDNN's algorithms), one `device<TAB>layer<TAB>choice` line each as
    /// `vae_tensor::cuda::export_conv_choices` writes them; `calibrate --model` records them,
    /// and a process that loads the profile imports them, so that it (and the group whose
    /// rank 0 it is) runs them instead of timing its own. Empty on CPU profiles and where none
    /// were recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conv_choices: Vec<String>,
}

impl DeviceProfile {
    /// Checks that the constants can predict anything: at least one core, thread and
    /// convolution rate, every rate positive and finite, the thread efficiency in `[0, 1]`;
    /// the reason otherwise.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 { Ok(()) } else { Err(format!("{name} must be positive and finite, not {v}")) }
        };
        if self.cores == 0 || self.threads == 0 {
            return Err("cores and threads must be at least 1".into());
        }
        for e in std::iter::once(self.thread_efficiency).chain(self.thread_efficiency_3d) {
            if !(0.0..=1.0).contains(&e) {
                return Err(format!("thread efficiencies must be in [0, 1], not {e}"));
            }
        }
        if self.convs.is_empty() {
            return Err("no convolution rates (convs)".into());
        }
        let not_negative = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be finite and not negative, not {v}"))
            }
        };
        for c in &self.convs {
            positive("a convolution's gmacs", c.gmacs)?;
            not_negative("a convolution's call_us", c.call_us)?;
            for &[positions, seconds] in &c.times {
                positive("a convolution's timed positions", positions)?;
                positive("a convolution's timed seconds", seconds)?;
            }
            if c.times.windows(2).any(|w| w[1][0] <= w[0][0]) {
                return Err("a convolution's times must be by increasing positions".into());
            }
            if self.kind == DeviceKind::Cuda && !c.times.is_empty() {
                return Err("a GPU profile's convolutions have a rate and a fixed cost per call, not times".into());
            }
        }
        not_negative("op_call_us", self.op_call_us)?;
        let dtypes: &[&str] = match self.kind {
            DeviceKind::Cpu => &["f32"],
            DeviceKind::Cuda => &["f32", "bf16", "tf32"],
        };
        if !dtypes.contains(&self.dtype.as_str()) {
            return Err(format!("dtype must be one of {dtypes:?} for a {:?} profile, not {:?}", self.kind, self.dtype));
        }
        positive("elementwise_gbps", self.elementwise_gbps)?;
        positive("attention_gmacs", self.attention_gmacs)?;
        positive("link_gbps", self.link_gbps)?;
        not_negative("link_latency_us", self.link_latency_us)
    }

    /// How much faster than one thread alone a rank runs with `threads` threads (a fraction
    /// where ranks share one pool) while `ranks` ranks work at once on this host. The host's
    /// busy cores (at most all of them) give `1 + (busy − 1)·e` times one thread's speed, shared
    /// equally by the ranks: a second core helps a second rank no more than a second thread of
    /// one rank. Measured on the 2-D convolution; [`Self::speedup_video`] for 3-D ones.
    pub fn speedup(&self, threads: f64, ranks: usize) -> f64 {
        self.speedup_with(self.thread_efficiency, threads, ranks)
    }

    /// [`Self::speedup`] for 3-D convolutions.
    pub fn speedup_video(&self, threads: f64, ranks: usize) -> f64 {
        self.speedup_with(self.thread_efficiency_3d.unwrap_or(self.thread_efficiency), threads, ranks)
    }

    fn speedup_with(&self, efficiency: f64, threads: f64, ranks: usize) -> f64 {
        let ranks = ranks.max(1) as f64;
        let busy = (threads.max(0.0) * ranks).min(self.cores.max(1) as f64);
        let host = if busy < 1.0 { busy } else { 1.0 + (busy - 1.0) * efficiency };
        host / ranks
    }

    /// The rate of a convolution: the measured shape, or the nearest one (same kernel and
    /// alignment class first, then the closest `C_in · C_out`). None without any measurement.
    pub fn conv_rate(
        &self,
        kernel: [usize; 3],
        align: usize,
        in_channels: usize,
        out_channels: usize,
    ) -> Option<&ConvRate> {
        let volume = |k: [usize; 3]| k.iter().product::<usize>();
        let size = |cin: usize, cout: usize| ((cin.max(1) * cout.max(1)) as f64).ln();
        let distance = |r: &ConvRate| {
            let kernel_miss = if r.kernel == kernel {
                0.0
            } else if volume(r.kernel) == volume(kernel) {
                1.0
            } else {
                4.0
            };
            let align_miss = if r.align == align { 0.0 } else { 2.0 };
            kernel_miss + align_miss + (size(r.in_channels, r.out_channels) - size(in_channels, out_channels)).abs()
        };
        self.convs.iter().min_by(|a, b| distance(a).total_cmp(&distance(b)))
    }

    /// Bytes per element of the maps on this device, where the profile decides it: a GPU
    /// profile's element type (`bf16`: 2; `f32` and `tf32`: 4). None on the CPU, whose maps are
    /// the model's (f32, also where its convolutions multiply in bf16).
    pub fn map_bytes(&self) -> Option<u64> {
        match (self.kind, self.dtype.as_str()) {
            (DeviceKind::Cuda, "bf16") => Some(2),
            (DeviceKind::Cuda, _) => Some(4),
            (DeviceKind::Cpu, _) => None,
        }
    }

    /// One call of a convolution of `in_channels → out_channels` through `kernel` producing
    /// `positions` output positions, on one thread (one GPU), from `rate`, its measured (or
    /// nearest) shape: `(fixed, rest)` seconds, the part paid by every call (per piece, where
    /// a convolution is split) and the rest.
    ///
    /// From the measured times where the profile has them; otherwise `call_us` and the
    /// multiply-adds at `gmacs`. On a CPU a shape not measured takes its nearest's time scaled
    /// by their weights' count (which is also their multiply-adds per position: the weights
    /// are packed or transformed on every call); on a GPU the fixed cost is the measured
    /// shape's (its launches).
    pub fn conv_call_s(
        &self,
        rate: &ConvRate,
        kernel: [usize; 3],
        [in_channels, out_channels]: [usize; 2],
        positions: f64,
    ) -> (f64, f64) {
        let weights = |k: [usize; 3], cin: usize, cout: usize| (k.iter().product::<usize>() * cin * cout).max(1) as f64;
        let per_position = weights(kernel, in_channels, out_channels);
        let scale = per_position / weights(rate.kernel, rate.in_channels, rate.out_channels);
        // The fixed part: the time of a call of no positions (the two smallest maps' line).
        if let (Some(total), Some(fixed)) = (rate.time_at(positions), rate.time_at(0.0)) {
            let fixed = fixed.min(total);
            return (scale * fixed, scale * (total - fixed));
        }
        let measured = rate.call_us * 1e-6;
        let fixed = match self.kind {
            DeviceKind::Cpu => measured * scale,
            DeviceKind::Cuda => measured,
        };
        (fixed, positions * per_position / (rate.gmacs * 1e9))
    }

    /// Whether shard convolutions overlap their halo exchange with the interior's compute on
    /// this device (the CPU layers do; the CUDA path exchanges first).
    pub fn overlaps_halos(&self) -> bool {
        self.kind == DeviceKind::Cpu
    }

    /// Seconds for `bytes` of element-wise traffic on one thread.
    pub fn elementwise_s(&self, bytes: f64) -> f64 {
        bytes / (self.elementwise_gbps * 1e9)
    }

    /// Seconds for one message of `bytes` between two ranks.
    pub fn message_s(&self, bytes: f64) -> f64 {
        self.link_latency_us * 1e-6 + bytes / (self.link_gbps * 1e9)
    }

    /// The constants `vae-parallel calibrate` measured on the 2-vCPU AVX-512/AMX Xeon guest
    /// this project is developed on (f32, 2026-12-03), for a device nobody calibrated: predictions then rank strategies but their absolute
    /// figures belong to that machine.
    pub fn builtin_cpu() -> Self {
        let conv = |kernel: [usize; 3], align: usize, in_channels: usize, out_channels: usize, gmacs: f64| ConvRate {
            kernel,
            align,
            in_channels,
            out_channels,
            gmacs,
            call_us: 0.0,
            times: Vec::new(),
        };
        Self {
            device: "cpu: built-in defaults (Intel Xeon guest, AVX-512 + AMX, f32)".into(),
            kind: DeviceKind::Cpu,
            dtype: f32_name(),
            source: "built-in defaults; run `vae-parallel calibrate` for this device".into(),
            cores: 2,
            threads: 2,
            thread_efficiency: 0.73,
            thread_efficiency_3d: None,
            convs: vec![
                conv([1, 3, 3], 1, 16, 512, 46.6),
                conv([1, 3, 3], 1, 512, 512, 55.9),
                conv([1, 3, 3], 2, 512, 512, 105.5),
                conv([1, 3, 3], 4, 512, 512, 136.5),
                conv([1, 3, 3], 4, 512, 256, 125.2),
                conv([1, 3, 3], 4, 256, 256, 129.5),
                conv([1, 3, 3], 4, 256, 128, 144.6),
                conv([1, 3, 3], 4, 128, 128, 144.9),
                conv([1, 3, 3], 4, 128, 3, 17.8),
                conv([1, 3, 3], 4, 3, 128, 14.3),
                conv([1, 3, 3], 2, 256, 512, 101.9),
                conv([1, 3, 3], 1, 512, 32, 31.6),
                conv([1, 3, 3], 1, 128, 128, 52.9),
                conv([1, 1, 1], 1, 512, 256, 48.4),
                conv([1, 1, 1], 1, 256, 128, 42.4),
                conv([3, 3, 3], 1, 16, 384, 55.0),
                conv([3, 3, 3], 1, 384, 384, 52.1),
                conv([3, 3, 3], 2, 384, 384, 107.9),
                conv([3, 3, 3], 2, 192, 384, 108.4),
                conv([3, 3, 3], 4, 192, 192, 140.7),
                conv([3, 3, 3], 4, 96, 96, 132.5),
                conv([3, 3, 3], 4, 96, 3, 16.5),
                conv([3, 1, 1], 1, 384, 768, 51.1),
                conv([1, 3, 3], 2, 384, 192, 70.9),
                conv([1, 3, 3], 4, 384, 192, 119.3),
                conv([1, 3, 3], 4, 192, 96, 134.5),
                conv([1, 1, 1], 1, 192, 384, 44.2),
            ],
            elementwise_gbps: 4.5,
            attention_gmacs: 44.2,
            op_call_us: 0.0,
            link_latency_us: 5.9,
            link_gbps: 2.16,
            conv_scratch_bytes: 16 << 10,
            conv_choices: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3×3 convolution of 8 → 8 channels (576 multiply-adds a position) timed at three sizes:
    /// 1 ms of fixed work, then 1 µs a position up to 10,000 positions, 2 µs a position beyond
    /// (its maps out of the caches).
    fn timed() -> ConvRate {
        ConvRate {
            kernel: [1, 3, 3],
            align: 4,
            in_channels: 8,
            out_channels: 8,
            gmacs: 1.0,
            call_us: 0.0,
            times: vec![[1000.0, 0.002], [10_000.0, 0.011], [20_000.0, 0.031]],
        }
    }

    fn cpu() -> DeviceProfile {
        DeviceProfile { convs: vec![timed()], ..DeviceProfile::builtin_cpu() }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn a_calls_time_follows_the_measured_sizes() {
        let r = timed();
        // Between two sizes, on the line through them; at a size, its time.
        assert!(close(r.time_at(10_000.0).unwrap(), 0.011));
        assert!(close(r.time_at(5_500.0).unwrap(), 0.0065));
        assert!(close(r.time_at(15_000.0).unwrap(), 0.021));
        // Below the smallest, the line through the two smallest: the fixed work stays.
        assert!(close(r.time_at(500.0).unwrap(), 0.0015));
        assert!(close(r.time_at(0.0).unwrap(), 0.001));
        // Above the largest, its average rate.
        assert!(close(r.time_at(40_000.0).unwrap(), 0.062));
        // Fewer than two sizes: no curve.
        assert!(ConvRate { times: vec![[1000.0, 0.002]], ..timed() }.time_at(10.0).is_none());
    }

    #[test]
    fn a_call_splits_into_its_fixed_work_and_the_rest_scaled_to_its_shape() {
        let p = cpu();
        let r = &p.convs[0];
        let (fixed, rest) = p.conv_call_s(r, [1, 3, 3], [8, 8], 5_500.0);
        assert!(close(fixed, 0.001) && close(fixed + rest, 0.0065), "{fixed} {rest}");
        // Twice the output channels: twice the weights and the multiply-adds a position.
        let (fixed, rest) = p.conv_call_s(r, [1, 3, 3], [8, 16], 5_500.0);
        assert!(close(fixed, 0.002) && close(fixed + rest, 0.013), "{fixed} {rest}");
        // Without times: `call_us` (scaled on a CPU) and the multiply-adds at `gmacs`.
        let line = ConvRate { times: Vec::new(), call_us: 100.0, ..timed() };
        let (fixed, rest) = p.conv_call_s(&line, [1, 3, 3], [8, 16], 1000.0);
        assert!(close(fixed, 200e-6) && close(rest, 1000.0 * 8.0 * 16.0 * 9.0 / 1e9), "{fixed} {rest}");
        let gpu = DeviceProfile { kind: DeviceKind::Cuda, ..p.clone() };
        assert!(close(gpu.conv_call_s(&line, [1, 3, 3], [8, 16], 1000.0).0, 100e-6));
    }

    #[test]
    fn times_must_be_positive_and_by_increasing_size() {
        assert_eq!(cpu().validate(), Ok(()));
        let with = |times: Vec<[f64; 2]>| DeviceProfile { convs: vec![ConvRate { times, ..timed() }], ..cpu() };
        assert!(with(vec![[1000.0, 0.002], [1000.0, 0.003]]).validate().unwrap_err().contains("increasing"));
        assert!(with(vec![[1000.0, 0.0]]).validate().unwrap_err().contains("seconds"));
        assert!(with(vec![[-1.0, 0.1]]).validate().unwrap_err().contains("positions"));
        // A profile written before the times reads without them.
        let old = "kernel = [1, 3, 3]\nalign = 4\nin_channels = 8\nout_channels = 8\ngmacs = 1.0\n";
        assert!(toml::from_str::<ConvRate>(old).unwrap().times.is_empty());
    }
}
