//! Running the ranks of a `local` group, each on a rayon pool of its own.
//!
//! Local ranks are threads of one process. Were their ops to share rayon's global pool, the
//! ranks' tasks would interleave on the same workers while the rank threads ran their serial
//! work (halo copies, the causal caches' concatenations) on top, and a shard, whose ranks wait
//! for each other at every convolution, runs slower so (a 2-rank Wan2.1 width shard took 8.2 s
//! on two cores, against 6.4–6.7 s with a pool each). Here each rank's body runs inside a pool of its own, of all the
//! threads, as a rank process that the socket transport starts on this host would: the
//! operating system shares the cores among the ranks that are busy, and a rank left alone with
//! the most work (a larger tile) gets every core, which a pool of an even share of the threads
//! would not give it (Wan2.1's two uneven tiles on 2 ranks: 6.5–6.6 s, against 8.0–8.2 s with one
//! thread each and 7.2 s sharing the global pool). Each rank's allocations, on whichever of its
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

/// Where `ranks` ranks on one host with pools of `threads` threads each (None: rayon's global
/// pool's size, as [`run_local_ranks`] and a rank process's own pool) run, for the cost model:
/// sharing the host's cores while they are busy, a rank left alone on all of them. Local ranks
/// and the socket transport's rank processes alike.
pub fn host_placement(threads: Option<usize>, ranks: usize) -> Placement {
    let threads = threads.unwrap_or_else(rayon::current_num_threads).max(1) as f64;
    Placement { threads_per_rank: threads, ranks_per_host: ranks.max(1), threads_alone: threads }
}

/// Runs `body` on `ranks` local ranks, each inside a rayon pool of its own of `threads` threads
/// (None: the size of rayon's global pool, all cores unless the program sized it), and returns
/// each rank's result in rank order; a rank that panics yields `Err` with the panic message,
/// and the others see it as a failed peer (as [`run_local`]).
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
    let threads = threads.unwrap_or_else(rayon::current_num_threads).max(1);
    let pools = (0..ranks)
        .map(|rank| {
            let account = Account::new();
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("vae-rank-{rank}-{i}"))
                .start_handler(move |_| account.adopt())
                .build()
                .map_err(|source| LocalRanksError::Pool { rank, source })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let body = &body;
    let pools = &pools;
    Ok(run_local(ranks, config, |comm| pools[comm.rank()].install(|| body(comm)))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_ranks_are_placed_as_processes_on_one_host() {
        let placement = host_placement(Some(4), 2);
        assert_eq!((placement.threads_per_rank, placement.ranks_per_host, placement.threads_alone), (4.0, 2, 4.0));
    }

    #[test]
    fn each_rank_runs_in_a_pool_of_its_own_and_charges_its_own_account() {
        let results = run_local_ranks(3, Some(2), TransportConfig::default(), |comm| {
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
}
