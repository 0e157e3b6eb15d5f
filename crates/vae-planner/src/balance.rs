//! Longest-processing-time-first (LPT) balancing of tiles over ranks.
//!
//! Every rank runs this on the same workloads and must arrive at the same
//! assignment without communicating, so the algorithm is fully specified,
//! tie-breaks included, and uses integer arithmetic only.

use crate::error::PlanError;

/// Result of balancing: which tasks each rank runs, and each rank's load.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Assignment {
    /// Task indices per rank, in the order they were assigned (heaviest
    /// first).
    pub per_rank: Vec<Vec<usize>>,
    /// Sum of the assigned workloads per rank.
    pub loads: Vec<u64>,
}

impl Assignment {
    /// Number of ranks the work was spread over.
    #[must_use]
    pub fn ranks(&self) -> usize {
        self.per_rank.len()
    }

    /// Number of tasks assigned in total.
    #[must_use]
    pub fn task_count(&self) -> usize {
        self.per_rank.iter().map(Vec::len).sum()
    }

    /// Rank that runs `task`, or `None` if no rank does.
    ///
    /// A linear scan; use [`Assignment::owners`] for repeated look-ups.
    #[must_use]
    pub fn rank_of(&self, task: usize) -> Option<usize> {
        self.per_rank.iter().position(|tasks| tasks.contains(&task))
    }

    /// Owner rank of every task, indexed by task (`None` where no rank has
    /// the task, which cannot happen for an [`lpt_assign`] result).
    #[must_use]
    pub fn owners(&self) -> Vec<Option<usize>> {
        let mut owners = vec![None; self.task_count()];
        for (rank, tasks) in self.per_rank.iter().enumerate() {
            for &task in tasks {
                if task >= owners.len() {
                    owners.resize(task + 1, None);
                }
                owners[task] = Some(rank);
            }
        }
        owners
    }

    /// The largest per-rank load (0 when there is no work).
    #[must_use]
    pub fn makespan(&self) -> u64 {
        self.loads.iter().copied().max().unwrap_or(0)
    }
}

/// Assigns task `i` (weight `workloads[i]`) to one of `ranks` ranks by LPT.
///
/// Exactly as the reference executor: task indices are sorted by workload,
/// descending, with a *stable* sort (equal workloads keep input order); each
/// task then goes to the rank with the smallest running load, ties going to
/// the lowest rank index.
///
/// Errors with [`PlanError::ZeroRanks`] when `ranks == 0` and
/// [`PlanError::WorkloadOverflow`] when a rank's load overflows `u64`.
pub fn lpt_assign(workloads: &[u64], ranks: usize) -> Result<Assignment, PlanError> {
    if ranks == 0 {
        return Err(PlanError::ZeroRanks);
    }
    let mut order: Vec<usize> = (0..workloads.len()).collect();
    // `sort_by` is stable, which is what makes equal workloads keep their
    // input order; an unstable sort would break cross-rank agreement.
    order.sort_by(|&a, &b| workloads[b].cmp(&workloads[a]));

    let mut assignment = Assignment { per_rank: vec![Vec::new(); ranks], loads: vec![0; ranks] };
    for task in order {
        let rank = least_loaded(&assignment.loads);
        assignment.loads[rank] =
            assignment.loads[rank].checked_add(workloads[task]).ok_or(PlanError::WorkloadOverflow)?;
        assignment.per_rank[rank].push(task);
    }
    Ok(assignment)
}

/// Index of the smallest load; the strict `<` keeps the lowest index on ties.
fn least_loaded(loads: &[u64]) -> usize {
    let mut best = 0;
    for (rank, &load) in loads.iter().enumerate().skip(1) {
        if load < loads[best] {
            best = rank;
        }
    }
    best
}
