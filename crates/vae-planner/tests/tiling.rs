//! Tile geometry against diffusers: reference numbers and coverage
//! properties.

use proptest::prelude::*;
use vae_planner::{
    AutoencoderKlTiling, AxisMerge, AxisPlan, AxisTiling, CropSegment, GridSpec, MergeRule, PlanError, TileLayout2d,
    WanTiling, grid_shape_from_last, lpt_assign, workloads,
};

/// The crop segments tile `[0, output_extent)` exactly once, in order, and
/// never read past a tile's kept part.
fn check_merge(m: &AxisMerge) {
    let segs: Vec<CropSegment> = m.crop_segments();
    assert_eq!(segs.len(), m.count());
    let mut cursor = 0;
    for (i, s) in segs.iter().enumerate() {
        assert_eq!(s.tile, i);
        assert_eq!(s.src.start, 0);
        assert_eq!(s.src.len(), s.dst.len());
        assert_eq!(s.dst.start, cursor, "segments must be contiguous");
        assert!(s.src.end <= m.kept(i).unwrap());
        assert!(m.kept(i).unwrap() <= m.tile_output_extent(i).unwrap());
        cursor = s.dst.end;
    }
    assert_eq!(cursor, m.output_extent());
    assert_eq!(m.blend_with_prev(0).unwrap_or(0), 0);
    for i in 1..m.count() {
        let e = m.blend_with_prev(i).unwrap();
        assert!(e <= m.tile_output_extent(i - 1).unwrap());
        assert!(e <= m.tile_output_extent(i).unwrap());
        assert!(e <= m.rule().blend);
        assert_eq!(m.blend_source(i).unwrap().len(), e);
        assert_eq!(m.blend_source(i).unwrap().end, m.tile_output_extent(i - 1).unwrap());
    }
}

/// Every input position belongs to some tile, tiles are in order and
/// clipped to the extent.
fn check_cover(t: &AxisTiling) {
    let pos = t.positions();
    assert_eq!(pos.len(), t.count());
    let mut covered = vec![false; t.extent()];
    for (i, &p) in pos.iter().enumerate() {
        let r = t.input_range(i).unwrap();
        assert_eq!(r.start, p);
        assert!(r.end <= t.extent() && !r.is_empty());
        assert!(r.len() <= t.tile());
        covered[r].iter_mut().for_each(|c| *c = true);
    }
    assert!(covered.iter().all(|&c| c));
    assert_eq!(t.input_range(t.count()), None);
}

fn check_layout(l: &TileLayout2d, expected_output: [usize; 2]) {
    check_cover(l.rows.tiling());
    check_cover(l.cols.tiling());
    check_merge(l.rows.merge());
    check_merge(l.cols.merge());
    assert_eq!(l.output_shape(), expected_output);
    // Row-major ids.
    let [_, cols] = l.grid_shape();
    for (k, tile) in l.tiles().enumerate() {
        assert_eq!(tile.tile_id, k);
        assert_eq!(tile.coord, [k / cols, k % cols]);
        assert_eq!(tile.workload, (tile.input[0].len() * tile.input[1].len()) as u64);
    }
}

#[test]
fn z_image_1152() {
    let kl = AutoencoderKlTiling::from_config(1024, 4);
    assert_eq!(kl.tile_latent_min_size, 128);
    assert_eq!(kl.decode_stride().unwrap(), 96);
    assert_eq!(kl.decode_rule().unwrap(), MergeRule { blend: 256, keep: 768, final_crop: None });
    assert!(kl.needs_tiling_decode(144, 144));
    assert!(!kl.needs_tiling_decode(128, 128));
    assert!(kl.needs_tiling_decode(128, 129));

    let l = kl.decode_layout(144, 144, 8).unwrap();
    assert_eq!(l.grid_shape(), [2, 2]);
    assert_eq!(l.input_shape(), [144, 144]);
    let tiles: Vec<_> = l.tiles().collect();
    assert_eq!(tiles.iter().map(|t| t.workload).collect::<Vec<_>>(), vec![16384, 6144, 6144, 2304]);
    assert_eq!(tiles[1].input, [0..128, 96..144]);
    assert_eq!(l.rows.merge().tile_output_extents(), &[1024, 384]);
    assert_eq!(l.rows.merge().blend_with_prev(1), Some(256));
    assert_eq!(l.rows.merge().kept(0), Some(768));
    assert_eq!(l.rows.merge().kept(1), Some(384));
    let [r, c] = l.placement([1, 0]).unwrap();
    assert_eq!((r.src, r.dst), (0..384, 768..1152));
    assert_eq!((c.src, c.dst), (0..768, 0..768));
    check_layout(&l, [1152, 1152]);
}

#[test]
fn autoencoder_kl_encode_reference() {
    let kl = AutoencoderKlTiling::from_config(512, 4);
    assert_eq!(kl.tile_latent_min_size, 64);
    assert_eq!(kl.encode_stride().unwrap(), 384);
    assert_eq!(kl.encode_rule().unwrap(), MergeRule { blend: 16, keep: 48, final_crop: None });
    assert!(!kl.needs_tiling_encode(512, 512));
    assert!(kl.needs_tiling_encode(513, 512));
    let l = kl.encode_layout(1000, 700, |n| n / 8).unwrap();
    check_layout(&l, [125, 87]);
}

#[test]
fn from_config_python_division() {
    // int(sample / 2 ** (n - 1)) with true division.
    assert_eq!(AutoencoderKlTiling::from_config(1000, 4).tile_latent_min_size, 125);
    assert_eq!(AutoencoderKlTiling::from_config(1001, 4).tile_latent_min_size, 125);
    assert_eq!(AutoencoderKlTiling::from_config(512, 1).tile_latent_min_size, 512);
    assert_eq!(AutoencoderKlTiling::from_config(512, 0).tile_latent_min_size, 1024);
    assert_eq!(AutoencoderKlTiling::from_config(512, 4000).tile_latent_min_size, 0);
}

#[test]
fn overlap_quirk_output_longer_than_input_times_scale() {
    // f = 0.3: stride int(64 * 0.7) = 44, blend int(512 * 0.3) = 153,
    // row_limit 359 > 44 * 8, so diffusers' output is longer than 800.
    let kl = AutoencoderKlTiling { tile_overlap_factor: 0.3, ..AutoencoderKlTiling::from_config(512, 4) };
    assert_eq!(kl.decode_stride().unwrap(), 44);
    assert_eq!(kl.decode_rule().unwrap(), MergeRule { blend: 153, keep: 359, final_crop: None });
    let l = kl.decode_layout(100, 64, 8).unwrap();
    assert_eq!(l.rows.merge().tile_output_extents(), &[512, 448, 96]);
    assert_eq!(l.rows.output_extent(), 359 + 359 + 96);
    check_merge(l.rows.merge());
}

#[test]
fn wan21_reference() {
    let wan = WanTiling::new(8, None);
    assert_eq!(wan.tile_latent_min().unwrap(), [32, 32]);
    assert_eq!(wan.tile_latent_stride().unwrap(), [24, 24]);
    let l = wan.decode_layout(60, 104).unwrap();
    assert_eq!(l.rows.merge().rule(), MergeRule { blend: 64, keep: 192, final_crop: Some(480) });
    assert_eq!(l.cols.merge().rule(), MergeRule { blend: 64, keep: 192, final_crop: Some(832) });
    check_layout(&l, [480, 832]);
    assert!(wan.needs_tiling_decode(33, 32).unwrap());
    assert!(!wan.needs_tiling_decode(32, 32).unwrap());
    assert!(wan.needs_tiling_encode(256, 257));
    assert!(!wan.needs_tiling_encode(256, 256));

    let enc = wan.encode_layout(480, 832, |n| n / 8).unwrap();
    assert_eq!(enc.rows.merge().rule(), MergeRule { blend: 8, keep: 24, final_crop: Some(60) });
    assert_eq!(enc.rows.tiling().stride(), 192);
    assert_eq!(enc.rows.tiling().tile(), 256);
    check_layout(&enc, [60, 104]);
}

#[test]
fn wan22_reference() {
    let wan = WanTiling::new(16, Some(2));
    assert_eq!(wan.tile_latent_min().unwrap(), [16, 16]);
    assert_eq!(wan.tile_latent_stride().unwrap(), [12, 12]);
    assert_eq!(wan.encode_compression_ratio().unwrap(), 8);
    let l = wan.decode_layout(44, 80).unwrap();
    // Patchified space: 704 / 2 = 352 rows, 1280 / 2 = 640 columns.
    assert_eq!(l.rows.merge().rule(), MergeRule { blend: 32, keep: 96, final_crop: Some(352) });
    assert_eq!(l.rows.merge().tile_output_extent(0), Some(128));
    check_layout(&l, [352, 640]);
    // `_decode` compares against 256 // 16, the unpatchified ratio.
    assert!(!wan.needs_tiling_decode(16, 16).unwrap());
    assert!(wan.needs_tiling_decode(16, 17).unwrap());

    // tiled_encode on the patchified input: pixel loop not divided by p.
    let enc = wan.encode_layout(352, 640, |n| n / 8).unwrap();
    assert_eq!(enc.cols.tiling().stride(), 192);
    assert_eq!(enc.cols.merge().rule(), MergeRule { blend: 8, keep: 24, final_crop: Some(80) });
    check_layout(&enc, [44, 80]);
}

#[test]
fn final_crop_cuts_trailing_tiles() {
    let rule = MergeRule { blend: 2, keep: 8, final_crop: Some(20) };
    let m = AxisMerge::new(vec![10, 10, 10], rule).unwrap();
    assert_eq!(m.concat_extent(), 24);
    assert_eq!(m.output_extent(), 20);
    let segs = m.crop_segments();
    assert_eq!((segs[2].src.clone(), segs[2].dst.clone()), (0..4, 16..20));
    let m = AxisMerge::new(vec![10, 10, 10], MergeRule { final_crop: Some(12), ..rule }).unwrap();
    let segs = m.crop_segments();
    assert_eq!(segs[1].dst, 8..12);
    assert!(segs[2].is_empty());
    assert_eq!(segs[2].dst, 12..12);
    // A crop beyond the concatenation changes nothing (no padding).
    let m = AxisMerge::new(vec![10, 10], MergeRule { final_crop: Some(99), ..rule }).unwrap();
    assert_eq!(m.output_extent(), 16);
    check_merge(&m);
}

#[test]
fn blend_clamps_to_neighbours() {
    let m = AxisMerge::new(vec![10, 3, 50], MergeRule { blend: 8, keep: 6, final_crop: None }).unwrap();
    assert_eq!((0..3).map(|i| m.blend_with_prev(i).unwrap()).collect::<Vec<_>>(), vec![0, 3, 3]);
    assert_eq!(m.blend_source(0), Some(0..0));
    assert_eq!(m.blend_source(1), Some(7..10));
    assert_eq!(m.blend_source(2), Some(0..3));
    assert_eq!(m.blend_with_prev(3), None);
    assert_eq!((0..3).map(|i| m.output_offset(i).unwrap()).collect::<Vec<_>>(), vec![0, 6, 9]);
}

#[test]
fn empty_extent() {
    let t = AxisTiling::new(0, 4, 3).unwrap();
    assert!(t.positions().is_empty());
    assert_eq!(t.count(), 0);
    let l = AutoencoderKlTiling::from_config(512, 4).decode_layout(0, 10, 8).unwrap();
    assert_eq!(l.tile_count(), 0);
    assert_eq!(l.tiles().count(), 0);
    assert_eq!(l.tile(0), None);
    assert_eq!(l.output_shape(), [0, 80]);
}

#[test]
fn errors() {
    let is_tiling = |r: Result<_, PlanError>| matches!(r, Err(PlanError::InvalidTiling { .. }));
    assert!(is_tiling(AxisTiling::new(10, 0, 1).map(|_| ())));
    assert!(is_tiling(AxisTiling::new(10, 4, 0).map(|_| ())));
    let t = AxisTiling::new(10, 4, 3).unwrap();
    let m = AxisMerge::new(vec![1, 2], MergeRule { blend: 0, keep: 1, final_crop: None }).unwrap();
    assert!(is_tiling(AxisPlan::new(t.clone(), m).map(|_| ())));
    assert!(is_tiling(
        AxisPlan::with_scale(t, MergeRule { blend: 0, keep: 1, final_crop: None }, usize::MAX).map(|_| ())
    ));

    let kl = AutoencoderKlTiling::from_config(512, 4);
    for f in [1.0, 1.5, -0.1, f64::NAN, f64::INFINITY] {
        let bad = AutoencoderKlTiling { tile_overlap_factor: f, ..kl };
        assert!(is_tiling(bad.decode_layout(100, 100, 8).map(|_| ())), "factor {f}");
    }
    assert!(is_tiling(WanTiling::new(0, None).decode_layout(10, 10).map(|_| ())));
    assert!(is_tiling(WanTiling::new(16, Some(0)).decode_layout(10, 10).map(|_| ())));
    assert!(is_tiling(WanTiling::new(16, Some(3)).decode_layout(10, 10).map(|_| ())));
    assert!(is_tiling(WanTiling::new(16, Some(3)).encode_compression_ratio().map(|_| ())));
    assert!(is_tiling(WanTiling::new(8, None).encode_layout_with_ratio(10, 10, 0, |n| n).map(|_| ())));
    assert!(WanTiling::new(0, None).needs_tiling_decode(1, 1).is_err());
    // Ratio larger than the tile: latent tile of zero.
    assert!(is_tiling(WanTiling::new(512, None).decode_layout(10, 10).map(|_| ())));
}

#[test]
fn layout_feeds_the_executor() {
    let l = AutoencoderKlTiling::from_config(1024, 4).decode_layout(144, 200, 8).unwrap();
    let tasks = l.to_tasks(|t| t.input.clone());
    let shape = grid_shape_from_last(&tasks).unwrap();
    assert_eq!(shape, l.grid_shape().to_vec());
    let spec: GridSpec<(), ()> =
        GridSpec { split_dims: vec![2, 3], grid_shape: shape, tile_spec: (), output_dtype: None };
    spec.validate_tasks(&tasks).unwrap();
    let a = lpt_assign(&workloads(&tasks), 3).unwrap();
    assert_eq!(a.task_count(), tasks.len());
}

proptest! {
    #[test]
    fn input_tiles_cover(extent in 0usize..600, tile in 1usize..80, stride_frac in 1usize..=100) {
        let stride = (tile * stride_frac).div_ceil(100).max(1);
        check_cover(&AxisTiling::new(extent, tile, stride).unwrap());
    }

    #[test]
    fn arbitrary_merge_segments(
        outs in prop::collection::vec(0usize..100, 0..12),
        blend in 0usize..64,
        keep in 0usize..100,
        crop in prop::option::of(0usize..800),
    ) {
        check_merge(&AxisMerge::new(outs, MergeRule { blend, keep, final_crop: crop }).unwrap());
    }

    #[test]
    fn autoencoder_kl_decode_exact(k in 1usize..=32, n in 1usize..=4, h in 0usize..400, w in 0usize..400) {
        // Latent tile a multiple of 4 keeps 0.25 overlap exact.
        let scale = 1usize << (n - 1);
        let kl = AutoencoderKlTiling::from_config(4 * k * scale, n);
        prop_assert_eq!(kl.tile_latent_min_size, 4 * k);
        let l = kl.decode_layout(h, w, scale).unwrap();
        check_layout(&l, [h * scale, w * scale]);
        prop_assert_eq!(l.rows.merge().concat_extent(), h * scale);
    }

    #[test]
    fn autoencoder_kl_encode_exact(h in 0usize..3000, w in 0usize..3000) {
        let l = AutoencoderKlTiling::from_config(512, 4).encode_layout(h, w, |n| n / 8).unwrap();
        check_layout(&l, [h / 8, w / 8]);
    }

    #[test]
    fn wan_decode_exact(h in 0usize..300, w in 0usize..300, model in 0usize..3) {
        let (wan, out_scale) = match model {
            0 => (WanTiling::new(8, None), 8),     // Wan2.1 / Qwen-Image
            1 => (WanTiling::new(16, Some(2)), 8), // Wan2.2, patchified
            _ => (WanTiling::new(16, None), 16),
        };
        let l = wan.decode_layout(h, w).unwrap();
        check_layout(&l, [h * out_scale, w * out_scale]);
        // The crop is a no-op at default settings: the kept parts already
        // add up to the sample size.
        prop_assert_eq!(l.rows.merge().concat_extent(), h * out_scale);
        prop_assert_eq!(l.cols.merge().concat_extent(), w * out_scale);
    }

    #[test]
    fn wan_encode_exact(h in 0usize..2000, w in 0usize..2000, patched in any::<bool>()) {
        let wan = if patched { WanTiling::new(16, Some(2)) } else { WanTiling::new(8, None) };
        let l = wan.encode_layout(h, w, |n| n / 8).unwrap();
        check_layout(&l, [h / 8, w / 8]);
    }
}
