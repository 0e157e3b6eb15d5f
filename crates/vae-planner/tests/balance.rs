//! LPT balancing: reference numbers, tie-breaks and quality bounds.

use proptest::prelude::*;
use vae_planner::{Assignment, PlanError, lpt_assign};

/// Smallest achievable makespan, by trying every assignment (`ranks^n`).
fn brute_force_optimum(workloads: &[u64], ranks: usize) -> u64 {
    let n = workloads.len();
    let mut best = u64::MAX;
    let mut choice = vec![0usize; n];
    loop {
        let mut loads = vec![0u64; ranks];
        for (task, &rank) in choice.iter().enumerate() {
            loads[rank] += workloads[task];
        }
        best = best.min(loads.into_iter().max().unwrap_or(0));
        // Odometer increment over base-`ranks` digits.
        let mut k = 0;
        loop {
            if k == n {
                return best;
            }
            choice[k] += 1;
            if choice[k] < ranks {
                break;
            }
            choice[k] = 0;
            k += 1;
        }
    }
}

fn assert_partition(a: &Assignment, n: usize) {
    let mut seen = vec![0usize; n];
    for tasks in &a.per_rank {
        for &t in tasks {
            seen[t] += 1;
        }
    }
    assert!(seen.iter().all(|&c| c == 1), "not a partition: {seen:?}");
}

#[test]
fn reference_example() {
    let w = [2, 5, 13, 8, 2, 4];
    let a = lpt_assign(&w, 2).unwrap();
    // Order by weight: 13(t2) 8(t3) 5(t1) 4(t5) 2(t0) 2(t4).
    // 13->r0, 8->r1, 5->r1 (8<13), 4->r0 (tie 13/13), 2->r1, 2->r1.
    assert_eq!(a.per_rank, vec![vec![2, 5], vec![3, 1, 0, 4]]);
    assert_eq!(a.loads, vec![17, 17]);
    assert_eq!(a.makespan(), 17);
    assert_eq!(a.rank_of(5), Some(0));
    assert_eq!(a.rank_of(4), Some(1));
    assert_eq!(a.rank_of(6), None);
    assert_eq!(a.owners(), vec![Some(1), Some(1), Some(0), Some(1), Some(1), Some(0)]);
    assert_eq!(a.task_count(), 6);
    assert_eq!(a.ranks(), 2);
}

#[test]
fn ties_go_to_lowest_rank_and_keep_input_order() {
    let a = lpt_assign(&[7, 7, 7, 7, 7], 3).unwrap();
    assert_eq!(a.per_rank, vec![vec![0, 3], vec![1, 4], vec![2]]);
    assert_eq!(a.loads, vec![14, 14, 7]);
}

#[test]
fn more_ranks_than_tasks() {
    let a = lpt_assign(&[3, 9], 4).unwrap();
    assert_eq!(a.per_rank, vec![vec![1], vec![0], vec![], vec![]]);
    assert_eq!(a.loads, vec![9, 3, 0, 0]);
    let empty = lpt_assign(&[], 3).unwrap();
    assert_eq!(empty.makespan(), 0);
    assert_eq!(empty.per_rank, vec![Vec::<usize>::new(); 3]);
}

#[test]
fn errors() {
    assert_eq!(lpt_assign(&[1], 0), Err(PlanError::ZeroRanks));
    assert_eq!(lpt_assign(&[u64::MAX, 1], 1), Err(PlanError::WorkloadOverflow));
}

proptest! {
    #[test]
    fn partition_and_determinism(w in prop::collection::vec(0u64..10_000, 0..40), ranks in 1usize..9) {
        let a = lpt_assign(&w, ranks).unwrap();
        let b = lpt_assign(&w, ranks).unwrap();
        prop_assert_eq!(&a, &b);
        assert_partition(&a, w.len());
        prop_assert_eq!(a.per_rank.len(), ranks);
        for (rank, tasks) in a.per_rank.iter().enumerate() {
            prop_assert_eq!(a.loads[rank], tasks.iter().map(|&t| w[t]).sum::<u64>());
            // Within a rank, tasks arrive heaviest first.
            prop_assert!(tasks.windows(2).all(|p| w[p[0]] >= w[p[1]]));
        }
        if w.len() <= ranks {
            // Every task gets its own rank, the leftover ranks stay empty.
            prop_assert!(a.per_rank.iter().all(|t| t.len() <= 1));
        }
    }

    #[test]
    fn quality_bounds(w in prop::collection::vec(1u64..100, 1..=8), ranks in 1usize..=4) {
        let a = lpt_assign(&w, ranks).unwrap();
        let opt = brute_force_optimum(&w, ranks);
        let largest = *w.iter().max().unwrap();
        prop_assert!(a.makespan() >= opt);
        prop_assert!(a.makespan() <= opt + largest);
        // Graham's bound, (4/3 - 1/(3m)) * OPT, in integers.
        let m = ranks as u64;
        prop_assert!(3 * m * a.makespan() <= (4 * m - 1) * opt, "{} vs opt {}", a.makespan(), opt);
    }
}
