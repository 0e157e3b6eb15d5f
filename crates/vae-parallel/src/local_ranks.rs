//! Running the ranks of a `local` group, each on a rayon pool of its own.
//!
//! Local ranks are threads of one process. Were their ops to share rayon's global pool, the
//! ranks' tasks would interleave on the same workers while the rank threads ran their serial
//! work (halo copies, the causal caches' concatenations) on top, and a shard, whose ranks wait
//! for each other at every convolution, runs slower so (a 2-rank Wan2.1 width shard took 8.2 s
//! on two cores, against 6.3–6.7 s with a pool each). Here each rank's body runs inside a pool
//! of its own, as a rank process that the socket transport starts on this host would. A pool
//! holds twice the rank's even share of the threads, all of them at most
//! ([`pool_threads`]): the operating system shares the cores among the ranks that are busy,
//! and a rank left alone with the most work (a larger tile) keeps up to twice its share busy,
//! which a pool of the share alone would not (Wan2.1's two uneven tiles on 2 ranks: 6.5–6.6 s
//! on two threads each, 8.0–8.2 s on one, 7.2 s sharing the global pool), while the threads of
//! a busy host stay within twice its cores. Each rank's allocations, on whichever of its
//! pool's threads they happen, are charged to the rank's account (its high-water mark).

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

/// The threads of each local rank's pool when `ranks` ranks share `threads` (None: rayon's
/// global pool's size, all cores unless the program sized it): twice an even share, at least
/// one and all of them at most.
pub fn pool_threads(threads: Option<usize>, ranks: usize) -> usize {
    let threads = threads.unwrap_or_else(rayon::current_num_threads).max(1);
    (2 * threads / ranks.max(1)).clamp(1, threads)
}

/// Where `ranks` ranks on one host run for the cost model, each with a pool of `threads`
/// threads (a local rank's [`pool_threads`], or a rank process's own pool): sharing the
/// host's cores while they are busy, a rank left alone on its pool.
pub fn host_placement(threads: usize, ranks: usize) -> Placement {
    let threads = threads.max(1) as f64;
    Placement { threads_per_rank: threads, ranks_per_host: ranks.max(1), threads_alone: threads }
}

/// [`host_placement`] of `ranks` local ranks sharing `threads` threads ([`pool_threads`]).
pub fn local_placement(threads: Option<usize>, ranks: usize) -> Placement {
    host_placement(pool_threads(threads, ranks), ranks)
}

/// The thread pools of a local group's ranks, one per rank, each charging its allocations to
/// the rank's own account (its high-water mark). Built once and kept: a [`Group`](crate::Group)
/// runs every request of its ranks on them.
pub struct RankPools {
    pools: Vec<rayon::ThreadPool>,
}

impl std::fmt::Debug for RankPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPools").field("ranks", &self.pools.len()).finish()
    }
}

impl RankPools {
    /// `ranks` pools of `each` threads ([`pool_threads`] shares a host's); the group's size is
    /// checked before any thread starts.
    pub fn new(ranks: usize, each: usize) -> Result<Self, LocalRanksError> {
        vae_transport::check_world_size(ranks)?;
        let each = each.max(1);
        let pools = (0..ranks)
            .map(|rank| {
                let account = Account::new();
                rayon::ThreadPoolBuilder::new()
                    .num_threads(each)
                    .thread_name(move |i| format!("vae-rank-{rank}-{i}"))
                    .start_handler(move |_| account.adopt())
                    .build()
                    .map_err(|source| LocalRanksError::Pool { rank, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { pools })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.pools.len()
    }

    /// The threads of each rank's pool.
    pub fn threads_per_rank(&self) -> usize {
        self.pools.first().map_or(1, rayon::ThreadPool::current_num_threads)
    }

    /// Runs `body` on every rank, each on a thread of its own inside its pool, over a fresh
    /// local group, and returns each rank's result in rank order; a rank that panics yields
    /// `Err` with the panic message, and the others see it as a failed peer (as [`run_local`]).
    pub fn run<R, F>(&self, config: TransportConfig, body: F) -> Result<Vec<Result<R, String>>, LocalRanksError>
    where
        R: Send,
        F: Fn(LocalComm) -> R + Sync,
    {
        config.validate()?;
        let body = &body;
        let pools = &self.pools;
        Ok(run_local(pools.len(), config, |comm| pools[comm.rank()].install(|| body(comm)))?)
    }
}

/// Runs `body` on `ranks` local ranks, each inside a rayon pool of its own of `each` threads
/// ([`RankPools`] made for this one run), and returns each rank's result in rank order.
pub fn run_local_ranks<R, F>(
    ranks: usize,
    each: usize,
    config: TransportConfig,
    body: F,
) -> Result<Vec<Result<R, String>>, LocalRanksError>
where
    R: Send,
    F: Fn(LocalComm) -> R + Sync,
{
    config.validate()?;
    RankPools::new(ranks, each)?.run(config, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_holds_twice_an_even_share_within_all_the_threads() {
        assert_eq!([1, 2, 3, 4, 8].map(|ranks| pool_threads(Some(2), ranks)), [2, 2, 1, 1, 1]);
        assert_eq!([1, 2, 3, 8, 64].map(|ranks| pool_threads(Some(64), ranks)), [64, 64, 42, 16, 2]);
        let placement = local_placement(Some(64), 8);
        assert_eq!((placement.threads_per_rank, placement.ranks_per_host, placement.threads_alone), (16.0, 8, 16.0));
    }

    #[test]
    fn each_rank_runs_in_a_pool_of_its_own_and_charges_its_own_account() {
        let results = run_local_ranks(3, pool_threads(Some(3), 3), TransportConfig::default(), |comm| {
            let rank = comm.rank();
            let before = vae_tensor::memory::live_bytes();
            // Allocated on each of the pool's threads.
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
        let names = |rank: usize| (0..2).map(|i| format!("vae-rank-{rank}-{i}")).collect::<Vec<_>>();
        assert_eq!(seen, [(0, names(0), 2048), (1, names(1), 2048), (2, names(2), 2048)]);
    }

    #[test]
    fn a_group_too_large_is_refused_before_any_thread_starts() {
        let err = run_local_ranks(1 << 20, 1, TransportConfig::default(), |_| ()).unwrap_err();
        assert!(matches!(err, LocalRanksError::Transport(_)), "{err}");
    }
}
