//! Halo exchanges: a band's (or block's) convolution input with its neighbours' edge rows and
//! columns, and zeros past the global edges.
//!
//! [`ShardContext::with_halo`] makes the whole haloed input before the convolution runs: the
//! computation waits for the slowest neighbour at every convolution. [`ShardContext::conv_with_halo`]
//! overlaps them instead: it hands the exchange to a helper thread, computes the interior (the
//! output rows and columns that read no halo) while the rows travel, then the edge strips around
//! it from what arrived, and places the pieces in one output. A neighbour that runs late then
//! costs nothing up to the interior's compute time.
//!
//! Both give the same bits. The direct kernels compute each output from its receptive field
//! alone, and the cuts between the pieces fall on multiples of the convolution's band alignment,
//! where the Winograd tiles of the whole computation start anyway
//! ([`vae_tensor::Conv2dParams::band_aligned`]).

use std::borrow::Cow;
use std::ops::Range;
use std::time::{Duration, Instant};

use vae_planner::ShardAxis;
use vae_tensor::{BoxOf, ConvTarget, DType, Device, Tensor};

use super::{AXES, HaloOverlap, ShardContext, Split, invalid};
use crate::RuntimeError;

/// What one piece of [`ShardContext::conv_with_halo`] reads of the haloed input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaloWindow {
    /// Rows and columns (height, width) of the haloed input the piece reads. Along a cut axis in
    /// the haloed part's coordinates (0 is the first halo row); along the other, all of it.
    pub spatial: [Range<usize>; 2],
    /// The haloed input's height and width.
    pub extent: [usize; 2],
}

impl HaloWindow {
    /// The window covering all of a haloed input of `extent`.
    fn whole(extent: [usize; 2]) -> Self {
        Self { spatial: [0..extent[0], 0..extent[1]], extent }
    }

    /// `t`, laid out as the haloed input along its last two dimensions (a causal convolution's
    /// cached frames, which keep their halos), cut to the window; borrowed where the window is
    /// all of it.
    pub fn narrow<'t>(&self, t: &'t Tensor) -> Result<Cow<'t, Tensor>, RuntimeError> {
        let rank = t.rank();
        if rank < 2 || t.dims()[rank - 2..] != self.extent {
            return Err(invalid(format!("a map {} is not laid out as the haloed input {:?}", t.shape(), self.extent)));
        }
        let mut out = Cow::Borrowed(t);
        for (i, range) in self.spatial.iter().enumerate() {
            if range.len() != self.extent[i] {
                out = Cow::Owned(out.narrow(rank - 2 + i, range.start, range.len())?);
            }
        }
        Ok(out)
    }
}

/// One piece of an overlapped convolution ([`ShardContext::conv_with_halo`]): the convolution
/// of `input` with `cut_padding` along the cut axes, into `target`.
#[derive(Debug)]
pub struct HaloPiece<'p> {
    /// What the convolution reads: this rank's part itself (the interior) or a haloed strip
    /// (an edge), or the whole haloed part.
    pub input: &'p Tensor,
    /// Which axes (height, width) the map is cut along.
    pub cut: [bool; 2],
    /// Zero padding `[top, bottom, left, right]` along the cut axes (entries of an axis that is
    /// not cut are 0: it keeps the layer's own padding; see [`Self::padding`]).
    pub cut_padding: [usize; 4],
    /// The part of the haloed input `input` stands for: the window of cached frames laid out as
    /// the haloed input ([`HaloWindow::narrow`]).
    pub window: HaloWindow,
    /// The outputs to compute (of the convolution of `input`) and where they go.
    pub target: ConvTarget<'p>,
}

impl HaloPiece<'_> {
    /// The convolution's padding for this piece, from the layer's own `[top, bottom, left,
    /// right]`: the piece's along the cut axes, the layer's along the others.
    pub fn padding(&self, own: [usize; 4]) -> [usize; 4] {
        let [ch, cw] = self.cut;
        let p = self.cut_padding;
        [
            if ch { p[0] } else { own[0] },
            if ch { p[1] } else { own[1] },
            if cw { p[2] } else { own[2] },
            if cw { p[3] } else { own[3] },
        ]
    }
}

/// One halo exchange of this rank's part: the pieces it sends, and where its neighbours' pieces
/// and its own part land in the haloed part.
struct Exchange {
    /// `(peer, piece sent, dims of the piece received)`, in ascending peer order.
    legs: Vec<(usize, Tensor, Vec<usize>)>,
    /// Per neighbour, where its piece lands in the haloed part (every dimension).
    places: Vec<(usize, Vec<usize>)>,
    /// Where this rank's own part lies in the haloed part.
    origin: Vec<usize>,
    /// The haloed part's dims.
    dims: Vec<usize>,
}

impl Exchange {
    /// The whole haloed part, as a range per dimension.
    fn whole(&self) -> Vec<Range<usize>> {
        self.dims.iter().map(|&d| 0..d).collect()
    }

    /// Where `peer`'s piece lands.
    fn place(&self, peer: usize) -> Result<&[usize], RuntimeError> {
        self.places
            .iter()
            .find(|(p, _)| *p == peer)
            .map(|(_, at)| at.as_slice())
            .ok_or_else(|| RuntimeError::Protocol(format!("a halo piece from rank {peer}, which is no neighbour")))
    }
}

impl ShardContext<'_> {
    /// `x` (this rank's band) with `halo` rows of each neighbour on either side along the axis,
    /// and zero rows at the global edges: the input of a convolution whose padding along the
    /// axis is then 0. Written into one buffer of the padded size. For a block of a 2-D grid,
    /// the same along both axes in one exchange with up to eight neighbours: rows from the
    /// blocks above and below, columns from those left and right, and the corners from the
    /// diagonal blocks.
    ///
    /// Every rank taking part must call it in the same order with the same `halo`.
    pub fn with_halo(&mut self, x: &Tensor, halo: usize) -> Result<Tensor, RuntimeError> {
        if halo == 0 {
            return Ok(x.clone());
        }
        let clock = Instant::now();
        let mut exchange = self.plan_exchange(x, halo)?;
        let legs = std::mem::take(&mut exchange.legs);
        let waiting = Instant::now();
        let (received, sent) = self.swap((&x.device(), x.dtype()), legs)?;
        let waited = waiting.elapsed();
        let mut sources = vec![(x, exchange.origin.as_slice())];
        for (peer, piece) in &received {
            sources.push((piece, exchange.place(*peer)?));
        }
        let whole = exchange.whole();
        let padded = assemble(x, &whole, &sources)?;
        self.record_halo(sent, clock.elapsed(), waited, false);
        Ok(padded)
    }

    /// A stride-1 convolution of `x`, this rank's part, whose input needs `halo` rows (and, on
    /// a grid, columns) of its neighbours; its output has `out_channels` channels and `x`'s
    /// other dims. `conv` computes one [`HaloPiece`]: the convolution of the piece's input,
    /// padded along the cut axes as the piece says (along the others as the layer pads; its
    /// kernel spans `2·halo + 1` along a cut axis), into the piece's target. Returns the output
    /// and, with `keep = (dim, range)`, that slice of the haloed input along a dimension that is
    /// not cut (a causal convolution's frames to cache).
    ///
    /// On the CPU the exchange runs on a helper thread while `conv` computes the interior
    /// straight from `x`; the edge strips follow from what arrived (see the module docs). Cuts
    /// between pieces fall on multiples of `align` from the part's start, which must be the
    /// convolution's band alignment. A part too small for an interior, a Winograd convolution
    /// (`align` ≥ 2) whose part is too small for the overlap to pay
    /// ([`vae_planner::overlap_pays`], counting the part's input positions × frames), a device
    /// tensor, or a context made without overlap exchange first ([`Self::with_halo`]) and
    /// compute one piece: the whole haloed input.
    ///
    /// Every rank taking part must call it in the same order with the same `halo`.
    pub fn conv_with_halo<E: From<RuntimeError>>(
        &mut self,
        x: Cow<'_, Tensor>,
        halo: usize,
        align: usize,
        out_channels: usize,
        keep: Option<(usize, Range<usize>)>,
        conv: &mut dyn FnMut(HaloPiece<'_>) -> Result<(), E>,
    ) -> Result<(Tensor, Option<Tensor>), E> {
        let hw = [self.dim_of(&x, ShardAxis::Height)?, self.dim_of(&x, ShardAxis::Width)?];
        let lens = hw.map(|d| x.dims()[d]);
        let cut = self.halo_axes();
        let halos = cut.map(|c| if c { halo } else { 0 });
        let kept_of = |t: &Tensor| -> Result<Option<Tensor>, RuntimeError> {
            Ok(keep.as_ref().map(|(dim, r)| t.narrow(*dim, r.start, r.len())).transpose()?)
        };
        // One piece: all of the output, from `input` (the haloed part, or the part when nothing
        // is exchanged), padded along no cut axis, into an empty destination, which takes it.
        let mut out = Tensor::zeros(vec![0; x.rank()], DType::F32, &Device::Cpu).map_err(RuntimeError::from)?;
        let mut whole = |input: &Tensor, out: &mut Tensor| -> Result<(), E> {
            let extent = hw.map(|d| input.dims()[d]);
            let window = [0..lens[0], 0..lens[1]];
            let target = ConvTarget { window, dest: out, at: [0, 0] };
            conv(HaloPiece { input, cut, cut_padding: [0; 4], window: HaloWindow::whole(extent), target })
        };
        // Overlapped where it pays (vae_planner::overlap): a Winograd kernel transforms its
        // weights again for every piece.
        let outputs = x.elem_count() / x.dims()[1].max(1);
        let neighbours = self.neighbours();
        let pieces = match self.overlap {
            HaloOverlap::Never => None,
            HaloOverlap::WherePays => vae_planner::overlap::pieces_where_pays(lens, halos, neighbours, align, outputs),
            HaloOverlap::Always => vae_planner::overlap::pieces(lens, halos, neighbours, align),
        }
        .filter(|_| x.device().is_cpu() && vae_tensor::conv_windows_in_place());
        if halo == 0 {
            let kept = kept_of(&x)?;
            whole(&x, &mut out)?;
            return Ok((out, kept));
        }
        let Some(pieces) = pieces else {
            let padded = self.with_halo(&x, halo)?;
            drop(x);
            let kept = kept_of(&padded)?;
            whole(&padded, &mut out)?;
            return Ok((out, kept));
        };

        let clock = Instant::now();
        let mut out_dims = x.dims().to_vec();
        out_dims[1] = out_channels;
        let mut out = Tensor::zeros(out_dims, x.dtype(), &x.device()).map_err(RuntimeError::from)?;
        let mut exchange = self.plan_exchange(&x, halo)?;
        let legs = std::mem::take(&mut exchange.legs);
        let extent = hw.map(|d| exchange.dims[d]);
        // The haloed input a piece of the output reads: every dimension, and as a window.
        let input_of = |piece: &[Range<usize>; 2]| {
            let spatial = [0, 1].map(|i| piece[i].start..piece[i].end + 2 * halos[i]);
            let mut window = exchange.whole();
            window[hw[0]] = spatial[0].clone();
            window[hw[1]] = spatial[1].clone();
            (window, HaloWindow { spatial, extent })
        };
        let own: Vec<Range<usize>> = exchange.origin.iter().zip(x.dims()).map(|(&o, &d)| o..o + d).collect();
        let (interior, edges) = pieces.split_first().expect("the interior comes first");
        // What the edges and the kept slice read of this rank's part, taken now so that an
        // owned part can go before the edges run.
        let strips = edges
            .iter()
            .map(|edge| {
                let meet = intersect(&input_of(edge).0, &own);
                let offset: Vec<usize> = meet.iter().map(|r| r.start).collect();
                Ok((assemble(&x, &meet, &[(&x, exchange.origin.as_slice())])?, offset))
            })
            .collect::<Result<Vec<(Tensor, Vec<usize>)>, RuntimeError>>()?;
        let (device, dtype) = (x.device(), x.dtype());
        let packing = clock.elapsed();

        // The interior, straight from the part: padded with the halo's extent along the cut axes
        // (zeros, which only the rows at a global edge read, as they should). The helper
        // thread's buffers count toward this rank's memory.
        let this = &*self;
        let account = vae_tensor::memory::Account::current();
        let (interior_done, own_kept, exchanged, waited) = std::thread::scope(|s| {
            let helper = std::thread::Builder::new().name("vae-halo".into()).spawn_scoped(s, move || {
                let _charged = account.enter();
                this.swap((&device, dtype), legs)
            });
            let helper = match helper {
                Ok(helper) => helper,
                Err(e) => {
                    let failed = RuntimeError::Protocol(format!("could not start the halo exchange's thread: {e}"));
                    return (Ok(()), Ok(None), Err(failed), Duration::ZERO);
                }
            };
            let center = HaloWindow { spatial: [0, 1].map(|k| halos[k]..halos[k] + lens[k]), extent };
            let [ph, pw] = halos;
            let target =
                ConvTarget { window: interior.clone(), dest: &mut out, at: [interior[0].start, interior[1].start] };
            let done = conv(HaloPiece { input: &x, cut, cut_padding: [ph, ph, pw, pw], window: center, target });
            // The kept slice of this rank's part: the part itself where it is all of it.
            let own_kept = match &keep {
                Some((dim, range)) if range.start == 0 && x.dims().get(*dim) == Some(&range.len()) => {
                    Ok(Some(x.into_owned()))
                }
                _ => kept_of(&x),
            };
            let waiting = Instant::now();
            let exchanged = helper
                .join()
                .unwrap_or_else(|_| Err(RuntimeError::Protocol("the halo exchange's thread panicked".into())));
            (done, own_kept, exchanged, waiting.elapsed())
        });
        interior_done?;
        let (received, sent) = exchanged?;
        let own_kept = own_kept?;

        let placing = Instant::now();
        let mut sources: Vec<(&Tensor, &[usize])> = strips.iter().map(|(t, at)| (t, at.as_slice())).collect();
        for (peer, piece) in &received {
            sources.push((piece, exchange.place(*peer)?));
        }
        let mut edge_compute = Duration::ZERO;
        for edge in edges {
            let (window, halo_window) = input_of(edge);
            let input = assemble(&out, &window, &sources)?;
            let started = Instant::now();
            let target = ConvTarget {
                window: [0..edge[0].len(), 0..edge[1].len()],
                dest: &mut out,
                at: [edge[0].start, edge[1].start],
            };
            conv(HaloPiece { input: &input, cut, cut_padding: [0; 4], window: halo_window, target })?;
            edge_compute += started.elapsed();
        }
        let kept = match (own_kept, &keep) {
            (Some(own_kept), Some((dim, range))) => {
                let cut = received
                    .iter()
                    .map(|(peer, piece)| Ok((piece.narrow(*dim, range.start, range.len())?, exchange.place(*peer)?)))
                    .collect::<Result<Vec<_>, RuntimeError>>()?;
                let mut sources = vec![(&own_kept, exchange.origin.as_slice())];
                sources.extend(cut.iter().map(|(t, at)| (t, *at)));
                let mut window = exchange.whole();
                window[*dim] = 0..range.len();
                Some(assemble(&own_kept, &window, &sources)?)
            }
            _ => None,
        };
        let overhead = packing + waited + placing.elapsed().saturating_sub(edge_compute);
        self.record_halo(sent, overhead, waited, true);
        Ok((out, kept))
    }

    /// Records one halo exchange: bytes sent, time spent on it and time blocked waiting.
    fn record_halo(&mut self, sent: u64, time: Duration, waited: Duration, overlapped: bool) {
        self.traffic.halo_exchanges += 1;
        self.traffic.halo_bytes_sent += sent;
        self.traffic.halo_time += time;
        self.traffic.halo_wait += waited;
        self.traffic.halo_overlapped += u64::from(overlapped);
    }

    /// This rank's place in the grid of parts, `([row, column], [rows, columns])`: bands along
    /// the height are an `[R, 1]` grid, along the width a `[1, C]` one.
    fn grid_place(&self) -> ([usize; 2], [usize; 2]) {
        match &self.split {
            Split::Bands { axis: ShardAxis::Height, bands } => ([self.rank, 0], [bands.len(), 1]),
            Split::Bands { axis: ShardAxis::Width, bands } => ([0, self.rank], [1, bands.len()]),
            Split::Blocks(grid) => (grid.coord(self.rank).expect("the rank takes part"), grid.grid()),
        }
    }

    /// Whether this part has a neighbour before and after it along the height and the width
    /// (`[[above, below], [left, right]]`); false where it reaches the map's edge, where
    /// [`Self::with_halo`] brings zeros.
    pub fn neighbours(&self) -> [[bool; 2]; 2] {
        let (at, grid) = self.grid_place();
        [0, 1].map(|k| [at[k] > 0, at[k] + 1 < grid[k]])
    }

    /// The exchange of `halo` rows along every cut axis: the edge rows of the parts above and
    /// below, the edge columns of those left and right, and a `halo × halo` corner of each
    /// diagonal part of a grid.
    fn plan_exchange(&self, x: &Tensor, halo: usize) -> Result<Exchange, RuntimeError> {
        let hw = [self.dim_of(x, AXES[0])?, self.dim_of(x, AXES[1])?];
        let halos = self.halo_axes().map(|cut| if cut { halo } else { 0 });
        let lens = hw.map(|d| x.dims()[d]);
        for ((axis, len), h) in AXES.into_iter().zip(lens).zip(halos) {
            if len < h {
                return Err(invalid(format!("rank {}'s {axis} of {len} is narrower than the halo {h}", self.rank)));
            }
        }
        let ([i, j], [rows, cols]) = self.grid_place();
        // Along one axis, for a neighbour at offset d (-1, 0, 1): which of this part's rows it
        // gets (start, len), and where its own rows land in the haloed part.
        let part = |d: isize, len: usize, h: usize| match d {
            -1 => (0, h),
            0 => (0, len),
            _ => (len - h, h),
        };
        let place = |d: isize, len: usize, h: usize| match d {
            -1 => 0,
            0 => h,
            _ => h + len,
        };
        let mut legs = Vec::with_capacity(8);
        let mut places = Vec::with_capacity(8);
        for di in -1isize..=1 {
            for dj in -1isize..=1 {
                let (Some(ni), Some(nj)) = (i.checked_add_signed(di), j.checked_add_signed(dj)) else { continue };
                if (di, dj) == (0, 0) || ni >= rows || nj >= cols {
                    continue;
                }
                let peer = ni * cols + nj;
                let (rs, rl) = part(di, lens[0], halos[0]);
                let (cs, cl) = part(dj, lens[1], halos[1]);
                let mut piece = Cow::Borrowed(x);
                for (dim, (start, len)) in hw.into_iter().zip([(rs, rl), (cs, cl)]) {
                    if len != x.dims()[dim] {
                        piece = Cow::Owned(piece.narrow(dim, start, len)?);
                    }
                }
                // What comes back is the neighbour's matching piece: the same extents.
                let mut dims = x.dims().to_vec();
                dims[hw[0]] = rl;
                dims[hw[1]] = cl;
                legs.push((peer, piece.into_owned(), dims));
                let mut at = vec![0; x.rank()];
                at[hw[0]] = place(di, lens[0], halos[0]);
                at[hw[1]] = place(dj, lens[1], halos[1]);
                places.push((peer, at));
            }
        }
        legs.sort_by_key(|(peer, _, _)| *peer);
        let mut origin = vec![0; x.rank()];
        let mut dims = x.dims().to_vec();
        for (k, &d) in hw.iter().enumerate() {
            origin[d] = halos[k];
            dims[d] += 2 * halos[k];
        }
        Ok(Exchange { legs, places, origin, dims })
    }

    /// Records that `cached`, a conv input kept from an earlier chunk with its `halo` rows
    /// already in place, was not exchanged again (for the traffic report).
    pub fn note_reused_halo(&mut self, cached: &Tensor, halo: usize) {
        if halo == 0 {
            return;
        }
        let (rank, ranks) = (self.rank, self.ranks());
        let neighbours: Vec<(ShardAxis, usize)> = match &self.split {
            Split::Bands { axis, .. } => vec![(*axis, usize::from(rank > 0) + usize::from(rank + 1 < ranks))],
            Split::Blocks(grid) => {
                let [i, j] = grid.coord(rank).expect("the rank takes part");
                let [r, c] = grid.grid();
                vec![
                    (ShardAxis::Height, usize::from(i > 0) + usize::from(i + 1 < r)),
                    (ShardAxis::Width, usize::from(j > 0) + usize::from(j + 1 < c)),
                ]
            }
        };
        let mut reused = 0;
        for (axis, count) in neighbours {
            let Ok(dim) = self.dim_of(cached, axis) else { return };
            let row_bytes = cached.size_in_bytes().checked_div(cached.dims()[dim]).unwrap_or(0);
            reused += count * halo * row_bytes;
        }
        self.traffic.halo_bytes_reused += reused as u64;
    }
}

/// The box where `a` and `b` (a range per dimension) meet; empty ranges where they do not.
fn intersect(a: &[Range<usize>], b: &[Range<usize>]) -> Vec<Range<usize>> {
    a.iter().zip(b).map(|(p, q)| p.start.max(q.start)..p.end.min(q.end).max(p.start.max(q.start))).collect()
}

/// The `window` (a range per dimension, in the haloed part's coordinates) of the haloed part:
/// zeros (the padding past the global edges), then every source (a tensor and where it lies in
/// the haloed part) copied where it meets the window. On `like`'s device, in its type.
fn assemble(like: &Tensor, window: &[Range<usize>], sources: &[(&Tensor, &[usize])]) -> Result<Tensor, RuntimeError> {
    let dims: Vec<usize> = window.iter().map(Range::len).collect();
    // Per source: where it meets the window (in the window's and the source's coordinates)
    // and how far, or nothing where it does not.
    let placed: Vec<(&Tensor, [Vec<usize>; 3])> = sources
        .iter()
        .filter_map(|&(src, at)| {
            let (mut to, mut from, mut extent) = (Vec::new(), Vec::new(), Vec::new());
            for (d, w) in window.iter().enumerate() {
                let (lo, hi) = (w.start.max(at[d]), w.end.min(at[d] + src.dims()[d]));
                if lo >= hi {
                    return None;
                }
                to.push(lo - w.start);
                from.push(lo - at[d]);
                extent.push(hi - lo);
            }
            Some((src, [to, from, extent]))
        })
        .collect();
    let boxes: Vec<BoxOf<'_>> =
        placed.iter().map(|(src, [to, from, extent])| BoxOf { src, from, to, extent }).collect();
    Ok(Tensor::from_boxes(dims, like.dtype(), &like.device(), &boxes)?)
}

#[cfg(test)]
mod tests {
    use vae_planner::{BandPartition, BlockGrid};
    use vae_tensor::{Conv2dParams, Conv3dParams, DType, Device};
    use vae_transport::{BytePathOnly, Communicator, TransportConfig, run_local};

    use super::super::ShardTraffic;
    use super::*;

    /// Each rank's halo'd band and gathered map of a [1, 2, 7, 5] map split in 3 height bands.
    fn halos_and_maps(comm: &dyn Communicator) -> (Tensor, Tensor, ShardTraffic) {
        let global = Tensor::seeded_uniform(vec![1, 2, 7, 5], 3, -1.0, 1.0, &Device::Cpu).unwrap();
        let bands = BandPartition::new(7, 3, 2).unwrap();
        let rank = comm.rank();
        let mut ctx = ShardContext::new(comm, ShardAxis::Height, bands, rank);
        let band = ctx.local_input(&global).unwrap();
        let padded = ctx.with_halo(&band, 2).unwrap();
        let map = ctx.all_gather_map(&band).unwrap();
        assert!(map.bit_eq(&global), "rank {rank}: the gathered map is the global one");
        (padded, map, ctx.traffic())
    }

    /// A block of a 2 × 3 grid with a halo of 2 is the global map's window around the block,
    /// corners included (from the diagonal blocks), zeros past the global edges; the gathered
    /// map is the global one and each rank's own block comes back from it; on the mailbox and
    /// the byte path alike.
    #[test]
    fn a_blocks_halo_is_the_window_around_it_corners_included() {
        let global = Tensor::seeded_uniform(vec![1, 2, 7, 8], 4, -1.0, 1.0, &Device::Cpu).unwrap();
        let grid = BlockGrid::new([7, 8], [2, 3], [2, 2]).unwrap();
        let halo = 2;
        let run = |comm: &dyn Communicator| {
            let rank = comm.rank();
            let mut ctx = ShardContext::blocks(comm, grid.clone(), rank);
            assert_eq!((ctx.axis(), ctx.halo_axes(), ctx.ranks()), (None, [true, true], 6));
            let block = ctx.local_input(&global).unwrap();
            let padded = ctx.with_halo(&block, halo).unwrap();
            let map = ctx.all_gather_map(&block).unwrap();
            assert!(map.bit_eq(&global), "rank {rank}: the gathered map is the global one");
            assert!(ctx.own_band(&map).unwrap().bit_eq(&block), "rank {rank}: its own block back");
            (padded, ctx.traffic())
        };
        let by_mailbox = run_local(6, TransportConfig::default(), |comm| run(&comm)).unwrap();
        let by_bytes = run_local(6, TransportConfig::default(), |comm| run(&BytePathOnly(comm))).unwrap();
        for (rank, (m, b)) in by_mailbox.into_iter().zip(by_bytes).enumerate() {
            let ((padded, traffic), (bytes_padded, _)) = (m.unwrap(), b.unwrap());
            assert!(padded.bit_eq(&bytes_padded), "rank {rank}: the same on both paths");
            assert_eq!(traffic.halo_exchanges, 1);
            let [rows, cols] = grid.block(rank).unwrap();
            assert_eq!(padded.dims(), &[1, 2, rows.len() + 2 * halo, cols.len() + 2 * halo]);
            let values = padded.to_vec_f32().unwrap();
            let whole = global.to_vec_f32().unwrap();
            let (ph, pw) = (rows.len() + 2 * halo, cols.len() + 2 * halo);
            for c in 0..2 {
                for y in 0..ph {
                    for x in 0..pw {
                        let (gy, gx) = ((rows.start + y) as isize - 2, (cols.start + x) as isize - 2);
                        let want = if (0..7).contains(&gy) && (0..8).contains(&gx) {
                            whole[(c * 7 + gy as usize) * 8 + gx as usize]
                        } else {
                            0.0
                        };
                        let got = values[(c * ph + y) * pw + x];
                        assert_eq!(got.to_bits(), want.to_bits(), "rank {rank}, channel {c}, global ({gy}, {gx})");
                    }
                }
            }
        }
    }

    #[test]
    fn the_mailbox_and_the_byte_path_give_the_same_halos() {
        let config = TransportConfig::default();
        let by_mailbox = run_local(3, config, |comm| {
            assert!(comm.mailbox().is_some(), "local ranks share a mailbox");
            halos_and_maps(&comm)
        })
        .unwrap();
        let by_bytes = run_local(3, config, |comm| halos_and_maps(&BytePathOnly(comm))).unwrap();
        let global = Tensor::seeded_uniform(vec![1, 2, 7, 5], 3, -1.0, 1.0, &Device::Cpu).unwrap();
        // Bands of 3, 2 and 2 rows; the halo is 2 rows, zeros beyond the global edges.
        for (rank, (m, b)) in by_mailbox.into_iter().zip(by_bytes).enumerate() {
            let ((mp, _, mt), (bp, _, bt)) = (m.unwrap(), b.unwrap());
            assert!(mp.bit_eq(&bp), "rank {rank}: same halo'd band on both paths");
            assert_eq!((mt.halo_bytes_sent, mt.map_bytes_sent), (bt.halo_bytes_sent, bt.map_bytes_sent));
            let (start, len) = [(0, 3), (3, 2), (5, 2)][rank];
            let (lo, hi) = (start as isize - 2, (start + len + 2) as isize);
            for row in lo..hi {
                let got = mp.narrow(2, (row - lo) as usize, 1).unwrap();
                let want = if (0..7).contains(&row) {
                    global.narrow(2, row as usize, 1).unwrap()
                } else {
                    Tensor::zeros(vec![1, 2, 1, 5], DType::F32, &Device::Cpu).unwrap()
                };
                assert!(got.bit_eq(&want), "rank {rank}, global row {row}");
            }
        }
    }

    /// How a test cuts a map of `[h, w]` rows of `align` pixels each: bands along an axis or a
    /// grid of blocks.
    #[derive(Debug, Clone)]
    enum Cut {
        Bands(ShardAxis, BandPartition),
        Blocks(BlockGrid),
    }

    impl Cut {
        fn context<'c>(&self, comm: &'c dyn Communicator, overlap: bool) -> ShardContext<'c> {
            self.context_with(comm, if overlap { HaloOverlap::Always } else { HaloOverlap::Never })
        }

        fn context_with<'c>(&self, comm: &'c dyn Communicator, overlap: HaloOverlap) -> ShardContext<'c> {
            let rank = comm.rank();
            match self {
                Cut::Bands(axis, bands) => ShardContext::new(comm, *axis, bands.clone(), rank),
                Cut::Blocks(grid) => ShardContext::blocks(comm, grid.clone(), rank),
            }
            .with_overlap(overlap)
        }

        /// This rank's `[rows, columns]` of a map `align` times the planned extents.
        fn part(&self, rank: usize, dims: &[usize], align: usize) -> [Range<usize>; 2] {
            let n = dims.len();
            let scaled = |r: Range<usize>| r.start * align..r.end * align;
            let whole = [0..dims[n - 2], 0..dims[n - 1]];
            match self {
                Cut::Bands(ShardAxis::Height, b) => [scaled(b.bands()[rank].clone()), whole[1].clone()],
                Cut::Bands(ShardAxis::Width, b) => [whole[0].clone(), scaled(b.bands()[rank].clone())],
                Cut::Blocks(g) => g.block(rank).unwrap().map(scaled),
            }
        }
    }

    fn window_of(t: &Tensor, [rows, cols]: &[Range<usize>; 2]) -> Tensor {
        let n = t.rank();
        t.narrow(n - 2, rows.start, rows.len()).unwrap().narrow(n - 1, cols.start, cols.len()).unwrap()
    }

    /// Per rank: the output of an overlapped and of a blocking 3×3 convolution of its part, and
    /// the traffic of the overlapped one.
    fn both_ways(
        cut: &Cut,
        ranks: usize,
        map: &Tensor,
        align: usize,
        weight: &Tensor,
    ) -> Vec<(Tensor, Tensor, ShardTraffic)> {
        let results = run_local(ranks, TransportConfig::default(), |comm| {
            let rank = comm.rank();
            let part = window_of(map, &cut.part(rank, map.dims(), align));
            let run = |overlap: bool| {
                let mut ctx = cut.context(&comm, overlap);
                let [cut_h, cut_w] = ctx.halo_axes();
                let padding = [usize::from(!cut_h), usize::from(!cut_h), usize::from(!cut_w), usize::from(!cut_w)];
                let mut conv = |piece: HaloPiece<'_>| {
                    let params = Conv2dParams::new(1, piece.padding(padding)).band_aligned(align);
                    piece.input.conv2d_into(weight, None, &params, piece.target).map_err(RuntimeError::from)
                };
                let (out, kept) = ctx.conv_with_halo(Cow::Borrowed(&part), 1, align, 6, None, &mut conv).unwrap();
                assert!(kept.is_none());
                (out, ctx.traffic())
            };
            let ((overlapped, traffic), (blocking, _)) = (run(true), run(false));
            (overlapped, blocking, traffic)
        })
        .unwrap();
        results.into_iter().map(Result::unwrap).collect()
    }

    /// An overlapped convolution gives each rank the bits of the whole map's convolution on its
    /// part (and of the blocking exchange), for bands along either axis and blocks of a grid,
    /// where band cuts fall on multiples of 1, 2 and 4 pixels (the direct kernel, and Winograd
    /// F(2×2) and F(4×4) tiles), including parts too thin for an interior.
    #[test]
    fn an_overlapped_convolution_is_the_whole_maps_bit_for_bit() {
        let weight = Tensor::seeded_uniform(vec![6, 8, 3, 3], 7, -0.5, 0.5, &Device::Cpu).unwrap();
        for align in [1, 2, 4] {
            let (h, w) = (9, 7);
            let map = Tensor::seeded_uniform(vec![2, 8, h * align, w * align], align as u64, -1.0, 1.0, &Device::Cpu)
                .unwrap();
            let whole = map.conv2d(&weight, None, &Conv2dParams::same(3).band_aligned(align)).unwrap();
            let cuts = [
                (Cut::Bands(ShardAxis::Height, BandPartition::new(h, 3, 1).unwrap()), 3),
                (Cut::Bands(ShardAxis::Width, BandPartition::new(w, 2, 1).unwrap()), 2),
                (Cut::Blocks(BlockGrid::new([h, w], [2, 3], [1, 1]).unwrap()), 6),
                // Bands of one latent row: no interior where the halo rounds up to the band.
                (Cut::Bands(ShardAxis::Height, BandPartition::new(h, 9, 1).unwrap()), 9),
            ];
            for (cut, ranks) in cuts {
                let mut overlaps = 0;
                for (rank, (overlapped, blocking, traffic)) in
                    both_ways(&cut, ranks, &map, align, &weight).into_iter().enumerate()
                {
                    let part = cut.part(rank, whole.dims(), align);
                    let want = window_of(&whole, &part);
                    assert!(overlapped.bit_eq(&want), "align {align}, {cut:?}, rank {rank}: overlapped");
                    assert!(blocking.bit_eq(&want), "align {align}, {cut:?}, rank {rank}: blocking");
                    assert_eq!(traffic.halo_exchanges, 1);
                    let (halos, at, grid) = match &cut {
                        Cut::Bands(ShardAxis::Height, b) => ([1, 0], [rank, 0], [b.len(), 1]),
                        Cut::Bands(ShardAxis::Width, b) => ([0, 1], [0, rank], [1, b.len()]),
                        Cut::Blocks(g) => ([1, 1], g.coord(rank).unwrap(), g.grid()),
                    };
                    let neighbours = [0, 1].map(|k| [at[k] > 0, at[k] + 1 < grid[k]]);
                    let interior =
                        vae_planner::overlap::pieces(part.map(|r| r.len()), halos, neighbours, align).is_some();
                    assert_eq!(traffic.halo_overlapped, u64::from(interior), "align {align}, {cut:?}, rank {rank}");
                    overlaps += traffic.halo_overlapped;
                }
                // Every cut but the bands of one latent row leaves some rank an interior.
                assert_eq!(overlaps > 0, ranks < 9, "align {align}, {cut:?}");
            }
        }
    }

    /// By default a direct convolution overlaps on any part with an interior, a Winograd one
    /// only on a part of at least `WINOGRAD_OUTPUTS_PER_EXTRA_PIECE` positions per edge strip
    /// (here one each: two bands); the bits are the whole map's either way.
    #[test]
    fn by_default_winograd_overlaps_only_on_large_parts() {
        let weight = Tensor::seeded_uniform(vec![6, 8, 3, 3], 7, -0.5, 0.5, &Device::Cpu).unwrap();
        let least = vae_planner::overlap::WINOGRAD_OUTPUTS_PER_EXTRA_PIECE;
        // Bands of 64 × 64 (4,096 positions) and of 128 × 256 (the threshold itself).
        for (side, wide, align, overlaps) in [(64, 64, 4, false), (64, 64, 1, true), (128, 256, 4, true)] {
            assert_eq!(overlaps, align == 1 || side * wide >= least);
            let h = 2 * side / align;
            let map = Tensor::seeded_uniform(vec![1, 8, 2 * side, wide], 3, -1.0, 1.0, &Device::Cpu).unwrap();
            let whole = map.conv2d(&weight, None, &Conv2dParams::same(3).band_aligned(align)).unwrap();
            let cut = Cut::Bands(ShardAxis::Height, BandPartition::new(h, 2, 1).unwrap());
            let results = run_local(2, TransportConfig::default(), |comm| {
                let part = window_of(&map, &cut.part(comm.rank(), map.dims(), align));
                let mut ctx = cut.context_with(&comm, HaloOverlap::WherePays);
                let mut conv = |piece: HaloPiece<'_>| {
                    let params = Conv2dParams::new(1, piece.padding([0, 0, 1, 1])).band_aligned(align);
                    piece.input.conv2d_into(&weight, None, &params, piece.target).map_err(RuntimeError::from)
                };
                let (out, _) = ctx.conv_with_halo(Cow::Borrowed(&part), 1, align, 6, None, &mut conv).unwrap();
                (out, ctx.traffic())
            })
            .unwrap();
            for (rank, result) in results.into_iter().enumerate() {
                let (out, traffic) = result.unwrap();
                let want = window_of(&whole, &cut.part(rank, whole.dims(), align));
                assert!(out.bit_eq(&want), "{side}x{wide}, align {align}, rank {rank}");
                assert_eq!(traffic.halo_overlapped, u64::from(overlaps), "{side}x{wide}, align {align}, rank {rank}");
            }
        }
    }

    /// With cached frames in front (a causal 3-D convolution reading the window of its cache)
    /// and a kept slice of frames, the overlapped exchange gives the blocking one's output and
    /// the haloed input's frames, on a 2 × 2 grid.
    #[test]
    fn an_overlapped_causal_convolution_keeps_the_haloed_frames() {
        let grid = BlockGrid::new([6, 8], [2, 2], [1, 1]).unwrap();
        let cut = Cut::Blocks(grid);
        let align = 2;
        let map = Tensor::seeded_uniform(vec![1, 4, 3, 12, 16], 11, -1.0, 1.0, &Device::Cpu).unwrap();
        let weight = Tensor::seeded_uniform(vec![5, 4, 3, 3, 3], 12, -0.5, 0.5, &Device::Cpu).unwrap();
        let results = run_local(4, TransportConfig::default(), |comm| {
            let part = window_of(&map, &cut.part(comm.rank(), map.dims(), align));
            let run = |overlap: bool| {
                let mut ctx = cut.context(&comm, overlap);
                // The cache: the blocking exchange's haloed part of the last two frames.
                let cache = ctx.with_halo(&part.narrow(2, 1, 2).unwrap(), 1).unwrap();
                let mut conv = |piece: HaloPiece<'_>| {
                    let cached = piece.window.narrow(&cache)?;
                    let [top, bottom, left, right] = piece.padding([0; 4]);
                    let params = Conv3dParams::new([1, 1, 1], [0, 0, top, bottom, left, right]).band_aligned(align);
                    Ok::<_, RuntimeError>(piece.input.conv3d_into(
                        Some(&cached),
                        &weight,
                        None,
                        &params,
                        piece.target,
                    )?)
                };
                let (out, kept) =
                    ctx.conv_with_halo(Cow::Owned(part.clone()), 1, align, 5, Some((2, 1..3)), &mut conv).unwrap();
                (out, kept.unwrap(), cache, ctx.traffic())
            };
            (run(true), run(false))
        })
        .unwrap();
        for (rank, result) in results.into_iter().enumerate() {
            let ((out, kept, cache, traffic), (want, want_kept, _, _)) = result.unwrap();
            assert_eq!(traffic.halo_overlapped, 1);
            assert!(out.bit_eq(&want), "rank {rank}: the output");
            assert!(kept.bit_eq(&want_kept), "rank {rank}: the kept frames");
            assert!(kept.bit_eq(&cache), "rank {rank}: the kept frames are the haloed last two");
        }
    }
}
