//! The decoder as a pipeline stage: a run of its layers applied one latent frame at a time with
//! their own causal cache, and a model that keeps only one stage's weights.
//!
//! A pipelined decode cuts the decoder's steps ([`super::decoder::Step`]) into stages, one per
//! rank. Each rank needs only its stage's weights, so a process that serves one stage can let go
//! of the others (and of the encoder) once it knows the request's shape and its place: the stage
//! cut depends on the latent's size (attention grows with the square of its pixels).

use std::ops::Range;

use vae_planner::StagePartition;
use vae_tensor::{DType, Tensor};

use super::cache::Pass;
use super::decoder::Carry;
use super::model::WanVae;
use crate::placement::{on_device, to_host};
use crate::{ModelError, Result};

/// One pipeline stage's decode in progress: the decoder steps it runs, their causal cache, the
/// next latent frame and, on the first stage, the latent after `post_quant_conv`.
pub(super) struct StageStream {
    latent: Option<Tensor>,
    steps: Range<usize>,
    pass: Pass<'static, 'static>,
    next: usize,
}

/// The one pipeline stage a model kept the weights of.
#[derive(Debug, Clone)]
pub(super) struct KeptStage {
    /// Its decoder steps (empty for a rank beyond the stages).
    steps: Range<usize>,
    /// The rank and the ranks of the pipeline it was cut for.
    rank: usize,
    ranks: usize,
    /// The latent size it was cut for, and the step costs the cut was made from (the
    /// released steps' weights no longer tell them).
    latent_hw: [usize; 2],
    pub(super) costs: Vec<u64>,
}

impl WanVae {
    /// Lets go of every weight the pipeline stage of `rank` does not use, in a pipelined decode
    /// of `latent_dims` latents over `ranks` ranks (the cut the executor will make: balanced on
    /// the decoder's step costs at that size): the other decoder steps, the encoder and
    /// `quant_conv`, and `post_quant_conv` unless the stage is the first. Returns the stage's
    /// steps (empty for a rank beyond the stages). The model then runs that stage of such
    /// requests and refuses every other request with a typed error.
    pub fn keep_only_pipeline_stage(
        &mut self,
        latent_dims: &[usize],
        ranks: usize,
        rank: usize,
    ) -> Result<Range<usize>> {
        if let Some(kept) = &self.kept_stage {
            return Err(ModelError::Unsupported(format!("{}: it already kept one", kept.describe())));
        }
        let &[_, channels, _, h, w] = latent_dims else {
            return Err(ModelError::InvalidInput(format!("a Wan latent is [B, C, T, H, W], got {latent_dims:?}")));
        };
        if channels != self.config.z_dim || h == 0 || w == 0 {
            return Err(ModelError::InvalidInput(format!(
                "a latent of shape {latent_dims:?} for a model of z_dim {}",
                self.config.z_dim
            )));
        }
        let costs = self.decoder.step_costs(h, w);
        let stages = StagePartition::balanced(&costs, ranks.clamp(1, costs.len()))
            .map_err(|e| ModelError::InvalidInput(format!("pipeline stages: {e}")))?;
        let steps = stages.stage(rank).unwrap_or(0..0);
        self.decoder.release_steps_outside(steps.clone())?;
        if steps.start != 0 || steps.is_empty() {
            self.post_quant_conv.release()?;
        }
        self.encoder = None;
        self.quant_conv = None;
        tracing::debug!(rank, ranks, ?steps, "kept one pipeline stage's weights");
        self.kept_stage = Some(KeptStage { steps: steps.clone(), rank, ranks, latent_hw: [h, w], costs });
        Ok(steps)
    }

    /// An error if the model kept only a pipeline stage (it cannot run the whole decoder, nor
    /// encode).
    pub(super) fn check_whole(&self) -> Result<()> {
        match &self.kept_stage {
            None => Ok(()),
            Some(kept) => Err(ModelError::Unsupported(format!(
                "{}: it runs that stage of a pipelined decode and nothing else",
                kept.describe()
            ))),
        }
    }

    /// The step costs of a pipelined decode of an `h × w` latent: the decoder's, or those a
    /// kept stage was cut from (its size must match).
    pub(super) fn pipeline_costs(&self, h: usize, w: usize) -> Result<Vec<u64>> {
        match &self.kept_stage {
            None => Ok(self.decoder.step_costs(h, w)),
            Some(kept) if kept.latent_hw == [h, w] => Ok(kept.costs.clone()),
            Some(kept) => Err(ModelError::Unsupported(format!("{}, not {h}x{w} ones", kept.describe()))),
        }
    }

    /// A pipeline stage running decoder `steps` on `z` a latent frame at a time
    /// ([`Self::stage_run`]); the first stage computes `post_quant_conv` of the whole latent, as
    /// the direct decode does.
    pub(super) fn start_stage(&self, z: &Tensor, steps: Range<usize>) -> Result<StageStream> {
        if let Some(kept) = self.kept_stage.as_ref().filter(|k| k.steps != steps) {
            return Err(ModelError::Unsupported(format!(
                "{}; the pipeline gave this rank steps {}..{} (were the ranks cut for another pipeline?)",
                kept.describe(),
                steps.start,
                steps.end
            )));
        }
        let latent = if steps.start == 0 {
            let mut uploaded = None;
            let zd = on_device(z, self.device(), self.dtype(), &mut uploaded)?;
            Some(self.post_quant_conv.forward(zd, None)?)
        } else {
            None
        };
        Ok(StageStream { latent, steps, pass: Pass::new(None), next: 0 })
    }

    /// Latent frame `run` through a stage: `carried` is the previous stage's result for it
    /// (the activation, then the pending DupUp3D shortcut if any; nothing on the first stage).
    /// Returns the same for the next stage, on the host in f32; from the last stage, the
    /// frame's output frames (unclamped).
    pub(super) fn stage_run(&self, stage: &mut StageStream, run: usize, carried: Vec<Tensor>) -> Result<Vec<Tensor>> {
        vae_runtime::cancel::check()?;
        if run != stage.next {
            return Err(ModelError::InvalidInput(format!("stage got latent frame {run}, expected {}", stage.next)));
        }
        let upload = |t: &Tensor| -> Result<Tensor> {
            let mut slot = None;
            Ok(on_device(t, self.device(), self.dtype(), &mut slot)?.clone())
        };
        let carry = match (&stage.latent, carried.as_slice()) {
            (Some(latent), []) => Carry { x: latent.narrow(2, run, 1)?, shortcut: None },
            (None, [x]) => Carry { x: upload(x)?, shortcut: None },
            (None, [x, shortcut]) => Carry { x: upload(x)?, shortcut: Some(upload(shortcut)?) },
            (first, given) => {
                return Err(ModelError::InvalidInput(format!(
                    "a stage {} got {} tensors from the previous one",
                    if first.is_some() { "that starts the decoder" } else { "inside the decoder" },
                    given.len()
                )));
            }
        };
        stage.pass.next_chunk();
        let out = self.decoder.forward_steps(stage.steps.clone(), carry, &mut stage.pass, run == 0)?;
        stage.next += 1;
        let host = |t: Tensor| -> Result<Tensor> {
            let t = to_host(t)?;
            Ok(if t.dtype() == DType::F32 { t } else { t.to_dtype(DType::F32)? })
        };
        let mut handed = vec![host(out.x)?];
        if let Some(shortcut) = out.shortcut {
            handed.push(host(shortcut)?);
        }
        Ok(handed)
    }
}

impl KeptStage {
    /// "this model keeps only the weights of pipeline stage 1 of 2 (decoder steps 14..20) for
    /// 60x104 latents".
    fn describe(&self) -> String {
        let [h, w] = self.latent_hw;
        let Range { start, end } = self.steps;
        format!(
            "this model keeps only the weights of pipeline stage {} of {} (decoder steps {start}..{end}) for {h}x{w} latents",
            self.rank, self.ranks
        )
    }
}
