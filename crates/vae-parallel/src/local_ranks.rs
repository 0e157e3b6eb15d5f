//! Running the ranks of a `local` group, each on its own share of the CPU's threads.
//!
//! Local ranks are threads of one process. Were their ops to share rayon's global pool, two
//! ranks' convolutions would be interleaved on the same workers while the rank threads
//! themselves ran their serial work (halo copies, the causal caches' concatenations) on top:
//! more threads than cores, and each rank's convolutions split for every core and then
//! contended for. A rank runs slower than the same rank alone in a process of its own. Here
//! each rank's body runs inside its own pool of `threads / ranks` threads (the first
//! `threads % ranks` ranks take one more; one each when there are more ranks than threads),
//! so a rank computes as a process of its own would and the cost model's per-rank threads
//! ([`threads_of_rank`]) are the threads the rank has. Each rank's allocations, on whichever of
//! its pool's threads they happen, are charged to the rank's account (its high-water mark).

use vae_planner::cost::Placement;
use vae_tensor::memory::Account;
use vae_transport::{Communicator, LocalComm, TransportConfig, TransportError, run_local};

/// Errors of starting a local group.
#[derive(Debug, thiserror::Error)]
pub enum LocalRanksError {
    /// A rank's thread pool could not be built (the OS refused a thread).
    #[error("building the thread pool of rank {rank}: {source}")]
    Pool {
        /// The rank.
        rank: usize,
        /// Rayon's error.
        #[source]
        source: rayon::ThreadPoolBuildError,
    },
    /// The group itself (its size, its settings, a rank's thread).
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// The threads rank `rank` of `ranks` local ranks gets out of `threads`: an even share, the
/// remainder going to the first ranks, and at least one.
pub fn threads_of_rank(threads: usize, ranks: usize, rank: usize) -> usize {
    let ranks = ranks.max(1);
    (threads / ranks + usize::from(rank < threads % ranks)).max(1)
}

/// The threads of the local rank with the fewest, the one that sets the pace of a balanced
/// request: [`threads_of_rank`]'s share, or a fraction of a thread where there are more ranks
/// than threads (they take turns on the cores).
pub fn slowest_rank_threads(threads: usize, ranks: usize) -> f64 {
    let ranks = ranks.max(1);
    if threads >= ranks { (threads / ranks) as f64 } else { threads.max(1) as f64 / ranks as f64 }
}

/// Where `ranks` local ranks sharing `threads` threads (None: rayon's global pool's size, as
/// [`run_local_ranks`]) run, for the cost model: each on the slowest rank's share, all on one
/// host, and a rank left alone keeps its own pool (at least a whole thread).
pub fn local_placement(threads: Option<usize>, ranks: usize) -> Placement {
    let threads = threads.unwrap_or_else(rayon::current_num_threads);
    let own = slowest_rank_threads(threads, ranks);
    Placement { threads_per_rank: own, ranks_per_host: ranks.max(1), threads_alone: own.max(1.0) }
}

/// Runs `body` on `ranks` local ranks sharing `threads` threads ([`threads_of_rank`] each, in a
/// pool of the rank's own) and returns each rank's result in rank order; a rank that panics
/// yields `Err` with the panic message, and the others see it as a failed peer (as
/// [`run_local`]). `threads`: None for the size of rayon's global pool (all cores unless the
/// program sized it).
pub fn run_local_ranks<R, F>(
    ranks: usize,
    threads: Option<usize>,
    config: TransportConfig,
    body: F,
) -> Result<Vec<Result<R, String>>, LocalRanksError>
where
    R: Send,
    F: Fn(LocalComm) -> R + Sync,
{
    let threads = threads.unwrap_or_else(rayon::current_num_threads);
    let pools = (0..ranks)
        .map(|rank| {
            let account = Account::new();
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads_of_rank(threads, ranks, rank))
                .thread_name(move |i| format!("vae-rank-{rank}-{i}"))
                .start_handler(move |_| account.adopt())
                .build()
                .map_err(|source| LocalRanksError::Pool { rank, source })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let body = &body;
    let pools = &pools;
    Ok(run_local(ranks, config, |comm| pools[Communicator::rank(&comm)].install(|| body(comm)))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_shared_evenly_with_at_least_one_each() {
        assert_eq!((0..2).map(|r| threads_of_rank(2, 2, r)).collect::<Vec<_>>(), [1, 1]);
        assert_eq!((0..3).map(|r| threads_of_rank(8, 3, r)).collect::<Vec<_>>(), [3, 3, 2]);
        assert_eq!((0..4).map(|r| threads_of_rank(2, 4, r)).collect::<Vec<_>>(), [1, 1, 1, 1]);
        assert_eq!(threads_of_rank(16, 1, 0), 16);
        assert_eq!(slowest_rank_threads(8, 3), 2.0);
        assert_eq!(slowest_rank_threads(2, 4), 0.5);
        assert_eq!(slowest_rank_threads(4, 1), 4.0);
        let two_of_four = local_placement(Some(4), 2);
        assert_eq!((two_of_four.threads_per_rank, two_of_four.threads_alone), (2.0, 2.0));
        let four_of_two = local_placement(Some(2), 4);
        assert_eq!(
            (four_of_two.threads_per_rank, four_of_two.ranks_per_host, four_of_two.threads_alone),
            (0.5, 4, 1.0)
        );
    }

    #[test]
    fn each_rank_runs_in_a_pool_of_its_share_and_charges_its_own_account() {
        let results = run_local_ranks(3, Some(5), TransportConfig::default(), |comm| {
            let rank = comm.rank();
            let before = vae_tensor::memory::live_bytes();
            // Allocated on whichever of the pool's threads picks the task up.
            let held: Vec<(String, vae_tensor::Tensor)> = rayon::broadcast(|_| {
                let name = std::thread::current().name().unwrap_or_default().to_string();
                (name, vae_tensor::Tensor::zeros(vec![256], vae_tensor::DType::F32, &vae_tensor::Device::Cpu).unwrap())
            });
            let charged = vae_tensor::memory::live_bytes() - before;
            let mut names: Vec<String> = held.into_iter().map(|(name, _)| name).collect();
            names.sort();
            (rank, names, charged)
        })
        .unwrap();
        let seen: Vec<_> = results.into_iter().map(Result::unwrap).collect();
        let names = |rank: usize, n: usize| (0..n).map(|i| format!("vae-rank-{rank}-{i}")).collect::<Vec<_>>();
        assert_eq!(seen, [(0, names(0, 2), 2048), (1, names(1, 2), 2048), (2, names(2, 1), 1024)]);
    }
}
