//! Pipeline stages: a model's layer sequence cut into contiguous runs of steps, one per rank,
//! so that the slowest stage (which sets the pipeline's pace) is as fast as it can be.
//!
//! A pipeline-parallel decode passes each latent frame through every stage in turn, stage `s`
//! on rank `s`, while the earlier stages already work on the next frames. After the pipeline
//! fills, a frame leaves about every `max_s cost(s)` (plus the hand-overs, and what the owner
//! does with each frame); the cut that minimises that maximum is found exactly by dynamic
//! programming over the (few dozen) steps.

use std::ops::Range;

use crate::PlanError;

/// Contiguous stages over `0..steps`: stage `s` runs steps `bounds[s]..bounds[s + 1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePartition {
    bounds: Vec<usize>,
    costs: Vec<u64>,
}

impl StagePartition {
    /// Cuts steps of the given relative `costs` into `stages` contiguous, non-empty stages whose
    /// largest total cost is the smallest possible; among equal cuts, the one whose earlier
    /// stages end first (deterministic, so every rank plans alike). Fewer steps than stages is
    /// an error (a stage would be empty).
    pub fn balanced(costs: &[u64], stages: usize) -> Result<Self, PlanError> {
        let n = costs.len();
        if stages == 0 {
            return Err(PlanError::ZeroRanks);
        }
        if n < stages {
            return Err(PlanError::InvalidStages {
                reason: format!("{n} step(s) cannot make {stages} non-empty stages"),
            });
        }
        let mut prefix = Vec::with_capacity(n + 1);
        prefix.push(0u64);
        for c in costs {
            let next = prefix.last().copied().unwrap_or(0).checked_add(*c).ok_or(PlanError::WorkloadOverflow)?;
            prefix.push(next);
        }
        let span = |a: usize, b: usize| prefix[b] - prefix[a];
        // best[k][i]: the smallest largest stage cost of the first i steps in k stages;
        // cut[k][i]: where its last stage starts.
        let mut best = vec![vec![u64::MAX; n + 1]; stages + 1];
        let mut cut = vec![vec![0usize; n + 1]; stages + 1];
        best[0][0] = 0;
        for k in 1..=stages {
            for i in k..=n {
                for j in (k - 1)..i {
                    if best[k - 1][j] == u64::MAX {
                        continue;
                    }
                    let worst = best[k - 1][j].max(span(j, i));
                    // `<`: the first (smallest) start of the last stage wins a tie.
                    if worst < best[k][i] {
                        best[k][i] = worst;
                        cut[k][i] = j;
                    }
                }
            }
        }
        let mut bounds = vec![n; stages + 1];
        let mut end = n;
        for k in (1..=stages).rev() {
            end = cut[k][end];
            bounds[k - 1] = end;
        }
        Ok(Self { bounds, costs: costs.to_vec() })
    }

    /// The number of stages.
    pub fn len(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Whether there are no stages (never, for a partition made by [`Self::balanced`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of steps cut.
    pub fn steps(&self) -> usize {
        self.costs.len()
    }

    /// Stage `s`'s steps, `None` past the last stage.
    pub fn stage(&self, s: usize) -> Option<Range<usize>> {
        (s < self.len()).then(|| self.bounds[s]..self.bounds[s + 1])
    }

    /// Stage `s`'s total cost (0 past the last stage).
    pub fn cost(&self, s: usize) -> u64 {
        self.stage(s).map_or(0, |r| self.costs[r].iter().sum())
    }

    /// The largest stage cost: the pipeline's pace once it is full.
    pub fn bottleneck(&self) -> u64 {
        (0..self.len()).map(|s| self.cost(s)).max().unwrap_or(0)
    }

    /// The fraction of a pipeline run of `runs` runs that a stage as costly as the bottleneck
    /// spends waiting while the pipeline fills and drains: `(N - 1) / (runs + N - 1)`.
    pub fn bubble(&self, runs: usize) -> f64 {
        let n = self.len();
        if n == 0 || runs == 0 {
            return 0.0;
        }
        (n - 1) as f64 / (runs + n - 1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The best cut by trying every one: the smallest largest stage cost.
    fn brute_force(costs: &[u64], stages: usize) -> u64 {
        fn go(costs: &[u64], stages: usize) -> u64 {
            if stages == 1 {
                return costs.iter().sum();
            }
            (1..=costs.len() - (stages - 1))
                .map(|first| costs[..first].iter().sum::<u64>().max(go(&costs[first..], stages - 1)))
                .min()
                .unwrap_or(u64::MAX)
        }
        go(costs, stages)
    }

    #[test]
    fn stages_cover_every_step_once_in_order() {
        let costs = [5, 1, 1, 9, 2, 2, 7, 3];
        for stages in 1..=costs.len() {
            let p = StagePartition::balanced(&costs, stages).unwrap();
            assert_eq!(p.len(), stages);
            let mut next = 0;
            for s in 0..stages {
                let r = p.stage(s).unwrap();
                assert_eq!(r.start, next);
                assert!(!r.is_empty(), "stage {s} of {stages} is empty");
                next = r.end;
            }
            assert_eq!(next, costs.len());
            assert_eq!(p.stage(stages), None);
        }
    }

    #[test]
    fn the_bottleneck_is_the_smallest_possible() {
        // A small deterministic generator: every cut of these is checked by brute force.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..200 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let n = 1 + (state >> 60) as usize % 10;
            let costs: Vec<u64> = (0..n)
                .map(|i| {
                    let x = state.rotate_left(7 * i as u32);
                    1 + (x >> 40) % 100
                })
                .collect();
            for stages in 1..=n {
                let p = StagePartition::balanced(&costs, stages).unwrap();
                assert_eq!(p.bottleneck(), brute_force(&costs, stages), "{costs:?} in {stages}");
            }
        }
    }

    #[test]
    fn a_heavy_tail_gets_a_stage_of_its_own() {
        // A decoder's shape: cheap low-resolution layers, then costly high-resolution ones.
        let costs = [1, 1, 1, 1, 2, 2, 8, 8, 16, 16];
        let p = StagePartition::balanced(&costs, 2).unwrap();
        assert_eq!(p.stage(0), Some(0..8));
        assert_eq!(p.stage(1), Some(8..10));
        assert_eq!((p.cost(0), p.cost(1), p.bottleneck()), (24, 32, 32));
    }

    #[test]
    fn ties_end_earlier_stages_first() {
        let p = StagePartition::balanced(&[1, 1, 1, 1], 3).unwrap();
        assert_eq!((p.stage(0), p.stage(1), p.stage(2)), (Some(0..1), Some(1..2), Some(2..4)));
    }

    #[test]
    fn too_few_steps_or_no_stages_are_errors() {
        assert!(matches!(StagePartition::balanced(&[1, 2], 3), Err(PlanError::InvalidStages { .. })));
        assert_eq!(StagePartition::balanced(&[1, 2], 0), Err(PlanError::ZeroRanks));
        assert!(matches!(StagePartition::balanced(&[u64::MAX, 1], 1), Err(PlanError::WorkloadOverflow)));
    }

    #[test]
    fn the_bubble_is_the_fill_and_drain_share() {
        let p = StagePartition::balanced(&[1, 1, 1], 3).unwrap();
        assert!((p.bubble(8) - 0.2).abs() < 1e-12);
        assert_eq!(StagePartition::balanced(&[1], 1).unwrap().bubble(5), 0.0);
    }
}
