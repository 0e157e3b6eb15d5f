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
    /// values, exactly as the whole decode would hold them there; the sink owns them. Runs
    /// arrive in order and without gaps, and together cover the `T` frames announced by
    /// [`Self::begin`].
    fn frames(&mut self, first: usize, run: Tensor) -> Result<(), SinkError>;
}

/// A decode's side of a sink: runs of finished frames fed in order, the sink told the whole
/// output's shape before the first (its frame count announced up front, the rest taken from
/// the first run), and a check at the end that every announced frame arrived.
pub struct FrameFeed<'a> {
    sink: &'a mut dyn FrameSink,
    total: usize,
    next: usize,
}

impl<'a> FrameFeed<'a> {
    /// A feed into `sink` of an output of `total` frames.
    pub fn new<'s: 'a>(sink: &'a mut (dyn FrameSink + 's), total: usize) -> Self {
        Self { sink, total, next: 0 }
    }

    /// Feeds the next run `[B, C, n, H, W]` (moved to the host in f32 if it is not there).
    pub fn feed(&mut self, run: Tensor) -> Result<(), SinkError> {
        let run = if run.dtype() == vae_tensor::DType::F32 { run } else { run.to_dtype(vae_tensor::DType::F32)? };
        let run = if run.device().is_cpu() { run } else { run.to_device(&vae_tensor::Device::Cpu)? };
        if self.next == 0 {
            let mut dims = run.dims().to_vec();
            if dims.len() != 5 {
                return Err(format!("a run of frames of shape {dims:?} is not [B, C, T, H, W]").into());
            }
            dims[2] = self.total;
            self.sink.begin(&dims)?;
        }
        let n = run.dims()[2];
        self.sink.frames(self.next, run)?;
        self.next += n;
        Ok(())
    }

    /// An error unless every announced frame was fed.
    pub fn finish(&self) -> Result<(), SinkError> {
        if self.next == self.total {
            return Ok(());
        }
        Err(format!("passed on {} frames, {} were announced", self.next, self.total).into())
    }
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

    fn frames(&mut self, first: usize, run: Tensor) -> Result<(), SinkError> {
        check_run(&self.dims, self.next, first, &run)?;
        self.next += run.dims()[2];
        self.chunks.push(run);
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

/// A sink run on a thread of its own, so that writing frame `t` (encoding PNGs, feeding an
/// encoder, writing a file) overlaps decoding frame `t + 1`. Runs wait in a queue of
/// `depth` (the memory of at most `depth + 1` runs besides the decoder's); when the queue is
/// full the decode waits for the sink. [`Self::finish`] returns the sink once it has taken
/// everything, or the first error it met.
pub struct OnOwnThread<S> {
    queue: Option<std::sync::mpsc::SyncSender<Message>>,
    thread: Option<std::thread::JoinHandle<(S, Result<(), SinkError>)>>,
}

enum Message {
    Begin(Vec<usize>),
    Frames(usize, Tensor),
}

impl<S: FrameSink + Send + 'static> OnOwnThread<S> {
    /// Starts `sink`'s thread, with room for `depth` runs in its queue.
    pub fn start(mut sink: S, depth: usize) -> std::io::Result<Self> {
        let (queue, received) = std::sync::mpsc::sync_channel::<Message>(depth);
        let thread = std::thread::Builder::new().name("frame-sink".into()).spawn(move || {
            let result = received.iter().try_for_each(|message| match message {
                Message::Begin(dims) => sink.begin(&dims),
                Message::Frames(first, run) => sink.frames(first, run),
            });
            // Dropping the receiver (on an error) makes the decode's next send fail at once.
            (sink, result)
        })?;
        Ok(Self { queue: Some(queue), thread: Some(thread) })
    }

    fn send(&mut self, message: Message) -> Result<(), SinkError> {
        let sent = self.queue.as_ref().map(|q| q.send(message).is_ok()).unwrap_or(false);
        if sent {
            return Ok(());
        }
        // The thread stopped: its own error says why.
        match self.join() {
            Ok(_) => Err("the frame sink's thread ended early".into()),
            Err(e) => Err(e),
        }
    }

    fn join(&mut self) -> Result<S, SinkError> {
        drop(self.queue.take());
        let thread = self.thread.take().ok_or("the frame sink's thread has already ended")?;
        let (sink, result) = thread.join().map_err(|_| "the frame sink panicked")?;
        result.map(|()| sink)
    }

    /// Waits for the sink to take every run sent, and returns it; or the first error it met.
    pub fn finish(mut self) -> Result<S, SinkError> {
        self.join()
    }
}

impl<S: FrameSink + Send + 'static> FrameSink for OnOwnThread<S> {
    fn begin(&mut self, dims: &[usize]) -> Result<(), SinkError> {
        self.send(Message::Begin(dims.to_vec()))
    }

    fn frames(&mut self, first: usize, run: Tensor) -> Result<(), SinkError> {
        self.send(Message::Frames(first, run))
    }
}

impl<S> Drop for OnOwnThread<S> {
    fn drop(&mut self) {
        // Unfinished (the decode failed): end the thread; the sink is dropped with it.
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vae_tensor::Device;

    fn run(first: usize, n: usize) -> Tensor {
        let values: Vec<f32> = (0..n * 4).map(|i| (first * 4 + i) as f32).collect();
        Tensor::from_vec(values, vec![1, 1, n, 2, 2], &Device::Cpu).unwrap()
    }

    #[test]
    fn a_sink_on_its_own_thread_receives_every_run_in_order() {
        let mut sink = OnOwnThread::start(CollectFrames::new(), 1).unwrap();
        sink.begin(&[1, 1, 9, 2, 2]).unwrap();
        sink.frames(0, run(0, 1)).unwrap();
        sink.frames(1, run(1, 4)).unwrap();
        sink.frames(5, run(5, 4)).unwrap();
        let whole = sink.finish().unwrap().into_tensor().unwrap();
        assert_eq!(whole.to_vec_f32().unwrap(), (0..36).map(|i| i as f32).collect::<Vec<_>>());
    }

    #[test]
    fn the_sinks_error_reaches_the_decode_and_finish() {
        let mut sink = OnOwnThread::start(CollectFrames::new(), 1).unwrap();
        sink.begin(&[1, 1, 9, 2, 2]).unwrap();
        // A gap: the collector refuses it on its thread; a later send or finish reports it.
        let _ = sink.frames(3, run(3, 1));
        let later = sink.frames(4, run(4, 1)).and_then(|()| sink.frames(5, run(5, 1)));
        let err = match later {
            Err(e) => e,
            Ok(()) => sink.finish().map(drop).unwrap_err(),
        };
        assert!(err.to_string().contains("do not continue"), "{err}");
    }
}
