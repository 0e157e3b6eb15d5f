//! A network as the cost model sees it: the steps of one forward pass over a whole map, each
//! with the shapes it reads and writes, in execution order.
//!
//! A family describes its encoder or decoder once, in these terms, from its config and the
//! input's shape; the model then derives every strategy's work, traffic and memory from it
//! (a band or block of the map runs the same steps on a part of every map).

/// What a step does, as far as its cost goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// A convolution with a `[frames, rows, columns]` kernel. A part of the map takes
    /// `kernel / 2` rows (columns) from each neighbour: overlapped with the interior, or first,
    /// into a copy of its input (see `overlapped`).
    Conv {
        /// Kernel extent along frames, rows and columns.
        kernel: [usize; 3],
        /// The rows one latent row spans where it runs (its band alignment: 1, 2, or 4 and
        /// more), which decides its algorithm on the CPU (direct, Winograd F(2×2), F(4×4)).
        align: usize,
        /// Whether a part overlaps the exchange with its interior (stride 1 on the CPU:
        /// `ShardContext::conv_with_halo`), which makes no halo'd copy of the part and hides
        /// the messages behind the interior's compute.
        overlapped: bool,
        /// Whether the layer pads its input into a copy before the kernel reads it even where
        /// it has no neighbour (replicated edges: HunyuanVideo-1.5, LTX); a part's halo then
        /// fills that copy. Only with `overlapped` false.
        pads: bool,
    },
    /// A normalisation (then, usually, SiLU) into a new map. `grouped`: GroupNorm, whose
    /// statistics span the whole map (one small all-reduce in a shard); otherwise per pixel.
    Norm {
        /// Whether the statistics span the map (GroupNorm) rather than one pixel (RMS norm).
        grouped: bool,
    },
    /// An element-wise pass: a residual addition in place (no new map) or a copy such as a
    /// nearest upsampling (a new map).
    Elementwise {
        /// Whether it writes into its input (no new map).
        in_place: bool,
    },
    /// Attention from every position to every other: a shard gathers the whole map, and every
    /// rank computes the whole attention.
    Attention,
}

/// One step: its kind, its input and output maps, and the other maps that stay alive while it
/// runs (a residual block's input), all over the whole map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// What the step does.
    pub kind: StepKind,
    /// Channels read.
    pub in_channels: usize,
    /// Channels written.
    pub out_channels: usize,
    /// The input map's `[frames, height, width]`.
    pub input: [usize; 3],
    /// The output map's `[frames, height, width]`.
    pub output: [usize; 3],
    /// Elements of other maps alive during the step, over the whole map (they shrink with a
    /// part of the map as the output does).
    pub resident: u64,
    /// Maps alive during the step that a part holds with its neighbours' edge (the causal
    /// caches, which keep their convolutions' input frames with their halos): the elements of one row of those
    /// maps across the whole width, and of one column across the whole height (each map's
    /// halo is one of its rows or columns deep). A part holds one such row per neighbour
    /// above or below (its share of the width) and one such column per neighbour to a side
    /// (its share of the height).
    pub resident_edges: [u64; 2],
    /// A convolution's temporal taps that read a frame, summed over its output frames: the
    /// kernel's extent per output frame, less the taps a causal convolution's zero padding
    /// leaves out (a video decoder's first latent frame has no cache). The CPU kernels skip
    /// those taps; the CUDA ones compute them (the cost model counts them there).
    pub frame_taps: usize,
}

impl StepKind {
    /// The kind in a prediction's breakdown: `conv 3x3x3` with, on a CPU, its algorithm
    /// (`direct`, or Winograd `F(2x2)` or `F(4x4)` by the band alignment), `norm`,
    /// `element-wise` or `attention`.
    pub fn label(&self, cpu: bool) -> String {
        match *self {
            StepKind::Conv { kernel: [t, h, w], align, .. } => {
                let extent = if t > 1 { format!("{t}x{h}x{w}") } else { format!("{h}x{w}") };
                let algorithm = match align_class(align) {
                    _ if !cpu || h != 3 || w != 3 => "",
                    4 => " F(4x4)",
                    2 => " F(2x2)",
                    _ => " direct",
                };
                format!("conv {extent}{algorithm}")
            }
            StepKind::Norm { .. } => "norm".into(),
            StepKind::Elementwise { .. } => "element-wise".into(),
            StepKind::Attention => "attention".into(),
        }
    }
}

impl Step {
    /// Elements of the whole input map (batch of one).
    pub fn input_elems(&self) -> u64 {
        self.in_channels as u64 * self.input.iter().map(|&d| d as u64).product::<u64>()
    }

    /// Elements of the whole output map (batch of one).
    pub fn output_elems(&self) -> u64 {
        self.out_channels as u64 * self.output.iter().map(|&d| d as u64).product::<u64>()
    }

    /// Multiply-adds of the whole step (batch of one; saturating): a convolution's
    /// `out pixels · C_in · C_out · kernel volume` (its temporal taps as [`Self::frame_taps`]
    /// counts them), attention's projections and its two products; zero for element-wise steps
    /// and norms.
    pub fn macs(&self) -> u64 {
        let pixels = |d: [usize; 3]| d.iter().map(|&x| x as u64).product::<u64>();
        match self.kind {
            StepKind::Conv { kernel, .. } => {
                let spatial = (kernel[1] * kernel[2]) as u64;
                let per_frame = self.output[1] as u64 * self.output[2] as u64;
                (per_frame * self.frame_taps as u64)
                    .saturating_mul(self.in_channels as u64 * self.out_channels as u64 * spatial)
            }
            StepKind::Attention => {
                let (n, c) = (pixels(self.input), self.in_channels as u64);
                // q, k, v and the output projection, then Q·Kᵀ and P·V.
                (4 * c * c).saturating_mul(n).saturating_add(n.saturating_mul(n).saturating_mul(2 * c))
            }
            StepKind::Norm { .. } | StepKind::Elementwise { .. } => 0,
        }
    }

    /// Rows (columns) the step needs from each neighbour of a part along an axis: half the
    /// kernel for a convolution, none otherwise.
    pub fn halo(&self) -> [usize; 2] {
        match self.kind {
            StepKind::Conv { kernel, .. } => [kernel[1] / 2, kernel[2] / 2],
            _ => [0, 0],
        }
    }
}

/// One forward pass over a whole input, batch of one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    /// The steps in execution order.
    pub steps: Vec<Step>,
    /// The latent extent `[height, width]` in the units a shard cuts (latent rows and
    /// columns): a part of `[a, b)` latent rows holds `(b − a) / height` of every map's rows.
    pub latent: [usize; 2],
    /// Elements of the input (batch of one).
    pub input_elems: u64,
    /// Elements of the output (batch of one).
    pub output_elems: u64,
    /// Bytes per element of the maps.
    pub elem_bytes: u64,
    /// The batch: every map holds this many inputs.
    pub batch: usize,
}

impl Network {
    /// Multiply-adds of the whole pass (the batch included; saturating).
    pub fn macs(&self) -> u64 {
        let pass = self.steps.iter().map(Step::macs).fold(0u64, u64::saturating_add);
        pass.saturating_mul(self.batch as u64)
    }

    /// Bytes of the input (the batch included).
    pub fn input_bytes(&self) -> u64 {
        self.batch as u64 * self.input_elems * self.elem_bytes
    }

    /// Bytes of the output (the batch included).
    pub fn output_bytes(&self) -> u64 {
        self.batch as u64 * self.output_elems * self.elem_bytes
    }
}

/// The alignment classes the CPU's algorithms tell apart: 1 (direct), 2 (F(2×2)), 4 (F(4×4),
/// for any multiple of 4).
pub fn align_class(align: usize) -> usize {
    if align.is_multiple_of(4) && align > 0 {
        4
    } else if align.is_multiple_of(2) && align > 0 {
        2
    } else {
        1
    }
}

/// Builds a [`Network`] step by step while tracking the current map, so a family writes its
/// forward pass once, in the order it runs.
#[derive(Debug, Clone)]
pub struct NetworkBuilder {
    steps: Vec<Step>,
    channels: usize,
    dims: [usize; 3],
    latent: [usize; 2],
    input_elems: u64,
    elem_bytes: u64,
    batch: usize,
    resident_edges: [u64; 2],
}

impl NetworkBuilder {
    /// A pass over an input of `channels × [frames, height, width]`, cut by a shard in units of
    /// `latent` rows and columns, with `elem_bytes` per element and `batch` inputs.
    pub fn new(channels: usize, dims: [usize; 3], latent: [usize; 2], elem_bytes: u64, batch: usize) -> Self {
        let input_elems = channels as u64 * dims.iter().map(|&d| d as u64).product::<u64>();
        Self { steps: Vec::new(), channels, dims, latent, input_elems, elem_bytes, batch, resident_edges: [0, 0] }
    }

    /// The [`Step::resident_edges`] of the steps pushed from now on (the caches alive, as the
    /// family's walk tracks them).
    pub fn set_resident_edges(&mut self, edges: [u64; 2]) -> &mut Self {
        self.resident_edges = edges;
        self
    }

    /// The current map's channels.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The current map's `[frames, height, width]`.
    pub fn dims(&self) -> [usize; 3] {
        self.dims
    }

    /// Elements of the current map.
    pub fn map_elems(&self) -> u64 {
        self.channels as u64 * self.dims.iter().map(|&d| d as u64).product::<u64>()
    }

    /// Appends a step from the current map to `out_channels × output`, with `resident` other
    /// elements alive; the output becomes the current map.
    pub fn push(&mut self, kind: StepKind, out_channels: usize, output: [usize; 3], resident: u64) -> &mut Self {
        let frame_taps = match kind {
            StepKind::Conv { kernel, .. } => output[0] * kernel[0],
            _ => output[0],
        };
        let (input, resident_edges) = (self.dims, self.resident_edges);
        self.steps.push(Step {
            kind,
            in_channels: self.channels,
            out_channels,
            input,
            output,
            resident,
            resident_edges,
            frame_taps,
        });
        self.channels = out_channels;
        self.dims = output;
        self
    }

    /// Appends a step that reads another map of the current size with `in_channels` channels
    /// (a residual block's shortcut reads the block's input), writing `out_channels × output`.
    pub fn push_from(
        &mut self,
        in_channels: usize,
        kind: StepKind,
        out_channels: usize,
        output: [usize; 3],
        resident: u64,
    ) -> &mut Self {
        self.channels = in_channels;
        self.push(kind, out_channels, output, resident)
    }

    /// Makes `channels × dims` the current map without a step (a layer that reads another map
    /// than the last step's output: a residual block's main path after its shortcut, the next
    /// chunk of a video decoded frame by frame).
    pub fn restart(&mut self, channels: usize, dims: [usize; 3]) -> &mut Self {
        self.channels = channels;
        self.dims = dims;
        self
    }

    /// A causal convolution (kernel `[kt, k, k]`, same size, band alignment `align`) behind
    /// `cached` frames of its previous input: `kt − 1 − cached` zero frames pad its front, and
    /// the taps that read them are skipped.
    pub fn causal_conv(
        &mut self,
        out_channels: usize,
        kernel: [usize; 3],
        align: usize,
        cached: usize,
        resident: u64,
    ) -> &mut Self {
        let front = kernel[0].saturating_sub(1 + cached);
        let frames = self.dims[0];
        self.conv(out_channels, kernel, align, resident);
        if let Some(step) = self.steps.last_mut() {
            step.frame_taps = (0..frames).map(|o| kernel[0].saturating_sub(front.saturating_sub(o))).sum();
        }
        self
    }

    /// A same-size convolution of kernel `[kt, k, k]` to `out_channels`, with band alignment
    /// `align` (see [`StepKind::Conv`]).
    pub fn conv(&mut self, out_channels: usize, kernel: [usize; 3], align: usize, resident: u64) -> &mut Self {
        let kind = StepKind::Conv { kernel, align: align_class(align), overlapped: true, pads: false };
        self.push(kind, out_channels, self.dims, resident)
    }

    /// A same-size convolution like [`Self::conv`] whose layer first pads its input into a
    /// copy (edges and front frames replicated; see [`StepKind::Conv`]'s `pads`): every
    /// temporal tap reads data, and a part exchanges its halo into that copy.
    pub fn padded_conv(&mut self, out_channels: usize, kernel: [usize; 3], align: usize, resident: u64) -> &mut Self {
        let kind = StepKind::Conv { kernel, align: align_class(align), overlapped: false, pads: true };
        self.push(kind, out_channels, self.dims, resident)
    }

    /// A new map of `out_channels × output` from the current one by an element-wise pass (a
    /// copy, a layout change, a resampling), with `resident` other elements alive.
    pub fn copy(&mut self, out_channels: usize, output: [usize; 3], resident: u64) -> &mut Self {
        self.push(StepKind::Elementwise { in_place: false }, out_channels, output, resident)
    }

    /// A 3×3 convolution of stride 2 (a downsampling): half the rows and columns.
    pub fn downsample(&mut self, out_channels: usize) -> &mut Self {
        let [t, h, w] = self.dims;
        let kind = StepKind::Conv { kernel: [1, 3, 3], align: 1, overlapped: false, pads: false };
        self.push(kind, out_channels, [t, h / 2, w / 2], 0)
    }

    /// A nearest 2× upsampling of rows and columns into a new map.
    pub fn upsample(&mut self) -> &mut Self {
        let [t, h, w] = self.dims;
        self.copy(self.channels, [t, 2 * h, 2 * w], 0)
    }

    /// A norm into a new map.
    pub fn norm(&mut self, grouped: bool, resident: u64) -> &mut Self {
        self.push(StepKind::Norm { grouped }, self.channels, self.dims, resident)
    }

    /// An in-place addition of a map of the same size.
    pub fn add(&mut self, resident: u64) -> &mut Self {
        self.push(StepKind::Elementwise { in_place: true }, self.channels, self.dims, resident)
    }

    /// Attention over every position, with a residual.
    pub fn attention(&mut self) -> &mut Self {
        self.push(StepKind::Attention, self.channels, self.dims, 0)
    }

    /// The network; its output is the current map.
    pub fn finish(self) -> Network {
        let output_elems = self.map_elems();
        Network {
            steps: self.steps,
            latent: self.latent,
            input_elems: self.input_elems,
            output_elems,
            elem_bytes: self.elem_bytes,
            batch: self.batch,
        }
    }
}
