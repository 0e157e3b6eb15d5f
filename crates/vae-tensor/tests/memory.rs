//! The per-thread high-water mark of live tensor bytes. Each test body runs on a fresh thread
//! so that its counters start at zero whatever else the test binary does.

use vae_tensor::{Conv2dParams, DType, Device, Tensor, memory};

fn on_fresh_thread(f: impl FnOnce() + Send + 'static) {
    std::thread::spawn(f).join().unwrap();
}

#[test]
fn allocations_clones_and_drops_move_the_counters() {
    on_fresh_thread(|| {
        assert_eq!((memory::live_bytes(), memory::peak_bytes()), (0, 0));
        let a = Tensor::zeros([10, 100], DType::F32, &Device::Cpu).unwrap();
        assert_eq!(memory::live_bytes(), 4000);
        let b = a.clone(); // a copy is charged again
        assert_eq!(memory::live_bytes(), 8000);
        let c = a.add(&b).unwrap();
        assert_eq!(memory::live_bytes(), 12_000);
        drop(a);
        drop(b);
        assert_eq!(memory::live_bytes(), 4000);
        assert_eq!(memory::peak_bytes(), 12_000);

        memory::reset_peak();
        assert_eq!(memory::peak_bytes(), 4000);
        let reshaped = c.into_reshaped([1000]).unwrap(); // no copy, no new charge
        assert_eq!(memory::live_bytes(), 4000);
        drop(reshaped);
        assert_eq!(memory::live_bytes(), 0);
        assert_eq!(memory::peak_bytes(), 4000);
    });
}

#[test]
fn a_tensor_dropped_on_another_thread_is_released_from_its_allocator() {
    on_fresh_thread(|| {
        let t = Tensor::from_vec(vec![1.0; 256], [256], &Device::Cpu).unwrap();
        assert_eq!(memory::live_bytes(), 1024);
        std::thread::spawn(move || {
            // Not charged here, so not released here either.
            assert_eq!(memory::live_bytes(), 0);
            drop(t);
            assert_eq!(memory::live_bytes(), 0);
        })
        .join()
        .unwrap();
        assert_eq!(memory::live_bytes(), 0);
        assert_eq!(memory::peak_bytes(), 1024);
    });
}

#[test]
fn op_scratch_counts_towards_the_peak_of_the_calling_thread() {
    on_fresh_thread(|| {
        let x = Tensor::zeros([1, 8, 16, 16], DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros([8, 8, 3, 3], DType::F32, &Device::Cpu).unwrap();
        let inputs = memory::live_bytes();
        memory::reset_peak();
        // Run on a 2-thread pool, as a rank with its own pool would: the closure runs on a pool
        // thread, and entering this thread's account charges it here.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let account = memory::Account::current();
        let y = pool.install(|| {
            let _charge_here = account.enter();
            x.conv2d(&w, None, &Conv2dParams::same(3)).unwrap()
        });
        let out = y.size_in_bytes();
        assert_eq!(memory::live_bytes(), inputs + out);
        // Beyond the output: the padded input copy (8·18·18) and padded-width result (8·16·18).
        let scratch = 4 * (8 * 18 * 18 + 8 * 16 * 18);
        assert!(memory::peak_bytes() >= inputs + out + scratch, "peak {} too low", memory::peak_bytes());
        drop((x, w, y));
        assert_eq!(memory::live_bytes(), 0);
    });
}

#[test]
fn entering_an_account_redirects_charges_until_the_guard_drops() {
    on_fresh_thread(|| {
        let account = memory::Account::new();
        let t = {
            let _guard = account.enter();
            let t = Tensor::zeros([100], DType::F32, &Device::Cpu).unwrap();
            assert_eq!(memory::live_bytes(), 400); // the entered account is the current one
            t
        };
        assert_eq!(memory::live_bytes(), 0);
        assert_eq!((account.live_bytes(), account.peak_bytes()), (400, 400));
        drop(t);
        assert_eq!(account.live_bytes(), 0);
        account.reset_peak();
        assert_eq!(account.peak_bytes(), 0);
    });
}

#[test]
fn into_vec_hands_the_memory_over_without_a_copy() {
    on_fresh_thread(|| {
        // Large enough (4 MiB) for the recycle pool to count it.
        let t = Tensor::from_vec(vec![1.5; 1 << 20], [1 << 20], &Device::Cpu).unwrap();
        let at = t.as_bytes().unwrap().as_ptr() as *const f32;
        assert_eq!(memory::live_bytes(), 4 << 20);
        let v = t.into_vec_f32().unwrap();
        assert_eq!(v.as_ptr(), at, "the same allocation, not a copy");
        assert_eq!(v.len(), 1 << 20);
        assert!(v.iter().all(|&x| x == 1.5));
        assert_eq!(memory::live_bytes(), 0, "no longer a tensor's memory");
        drop(v);
        assert_eq!(memory::live_bytes(), 0);
    });
}

#[test]
fn a_lent_tensor_reads_the_owners_memory_in_place_and_copies_before_a_write() {
    on_fresh_thread(|| {
        let owner = std::sync::Arc::new(vec![2.0f32; 1 << 18]);
        let at = owner.as_ptr();
        // SAFETY: `owner` keeps the values alive and nobody writes them.
        let mut t = unsafe { Tensor::lent(at, [1 << 18], owner.clone()) };
        assert_eq!(t.as_bytes().unwrap().as_ptr() as *const f32, at, "read in place");
        assert_eq!(memory::live_bytes(), 0, "the owner's memory is not charged");
        assert_eq!(std::sync::Arc::strong_count(&owner), 2, "the tensor keeps the owner");
        let ones = Tensor::from_vec(vec![1.0; 1 << 18], [1 << 18], &Device::Cpu).unwrap();
        t.add_assign(&ones).unwrap();
        assert!(t.to_vec_f32().unwrap().iter().all(|&x| x == 3.0));
        assert!(owner.iter().all(|&x| x == 2.0), "the lent memory was never written");
        assert_ne!(t.as_bytes().unwrap().as_ptr() as *const f32, at, "written into a copy");
        assert_eq!(std::sync::Arc::strong_count(&owner), 1, "the copy let the owner go");
        drop((t, ones));
        assert_eq!(memory::live_bytes(), 0);
    });
}
