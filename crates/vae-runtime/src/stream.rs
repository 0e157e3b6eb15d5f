//! Decoded video frames handed on as they are made.
//!
//! The video decoders are causal: output frame `t` depends only on latent frames up to the one
//! that produced it, so a decode can pass each latent frame's output frames to a
//! [`FrameSink`] and drop them, instead of holding the whole video (241 frames of 3840×2160 in
//! f32 are 24 GB) until the end. A sink is told the whole output's shape first, then receives
//! consecutive runs of frames in order.

use vae_tensor::Tensor;

/// A sink's own failure (a write that failed, a full disk), with its causes.
pub type SinkError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Where a streaming decode puts its output frames.
pub trait FrameSink {
    /// Called once, before any frames: the whole output's dims `[B, C, T, H, W]`.
    fn begin(&mut self, dims: &[usize]) -> Result<(), SinkError>;
    /// Output frames `first..first + n` of every batch item, as `[B, C, n, H, W]` host f32
    /// values, exactly as the whole decode would hold them there. Runs arrive in order and
    /// without gaps, and together cover the `T` frames announced by [`Self::begin`].
    fn frames(&mut self, first: usize, chunk: &Tensor) -> Result<(), SinkError>;
}

/// A sink that keeps every frame and assembles the whole output: for tests and for callers
/// that want the streamed decode's result as one tensor.
#[derive(Debug, Default)]
pub struct CollectFrames {
    dims: Vec<usize>,
    chunks: Vec<Tensor>,
    next: usize,
}

impl CollectFrames {
    /// An empty collector.
    pub fn new() -> Self {
        Self::default()
    }

    /// The frames received, as one `[B, C, T, H, W]` tensor; an error unless every frame
    /// announced arrived.
    pub fn into_tensor(self) -> Result<Tensor, SinkError> {
        if self.dims.len() != 5 || self.next != self.dims[2] {
            return Err(format!("received {} of the frames of {:?}", self.next, self.dims).into());
        }
        let refs: Vec<&Tensor> = self.chunks.iter().collect();
        Ok(Tensor::cat(&refs, 2)?)
    }
}

impl FrameSink for CollectFrames {
    fn begin(&mut self, dims: &[usize]) -> Result<(), SinkError> {
        self.dims = dims.to_vec();
        Ok(())
    }

    fn frames(&mut self, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
        check_run(&self.dims, self.next, first, chunk)?;
        self.next += chunk.dims()[2];
        self.chunks.push(chunk.clone());
        Ok(())
    }
}

/// An error unless `chunk` is the run of frames that must come next: frame `next` on, of the
/// announced `dims` in every other axis, not past the last frame. Sinks call it to hold
/// decoders to the contract.
pub fn check_run(dims: &[usize], next: usize, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
    let d = chunk.dims();
    let fits = dims.len() == 5
        && d.len() == 5
        && first == next
        && [d[0], d[1], d[3], d[4]] == [dims[0], dims[1], dims[3], dims[4]]
        && first + d[2] <= dims[2];
    if fits {
        Ok(())
    } else {
        Err(format!("frames {first}.. of shape {d:?} do not continue an output of {dims:?} at frame {next}").into())
    }
}
