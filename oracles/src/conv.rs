//! A convolution's weight site stored as the convolution's input and geometry (trace format
//! `ghost-oracle-trace/2`), instead of as unfolded patches: each input value is held once, and
//! an example's patches are unfolded only when that example is read ([`ConvInput::unfold`]).
//!
//! The gradient it defines is the unfolded `linear` site's of format /1, entry for entry: rows
//! are (output position, group) pairs, position-major, the group fastest (row p·g + j); a row's
//! activations are group j's patch, its C_in/g channels major and the kernel offsets row-major
//! within each (torch's weight layout C_out × C_in/g × k…), and its backprops the output's
//! gradient at position p with every other group's channels zeroed. For example i, output channel
//! o of group j and column (c, κ):
//!
//! ```text
//! G_i[o, (c, κ)] = Σ_p δ_i[p, o] · x̃_i[j·C_in/g + c, p_1·s_1 + κ_1·d_1, …, p_n·s_n + κ_n·d_n]
//! ```
//!
//! x̃ the input zero-padded by (lo_d, hi_d) on each spatial axis.

use crate::error::{bail, Result};
use crate::factors::{Factors, HeldExample};
use ndarray::{Array2, Array3, ArrayView2, CowArray, Ix2};

/// The largest kernel size, stride, dilation, padding, spatial size or group count a trace may
/// give: far beyond any convolution, and small enough that the products below cannot overflow
/// before they are checked.
pub const MAX_CONV_ENTRY: usize = 1 << 32;

/// A convolution's geometry over n ≥ 1 spatial axes, with the spatial sizes of its input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvGeometry {
    /// k_d, the kernel's size on each axis (≥ 1).
    pub kernel: Vec<usize>,
    /// s_d (≥ 1).
    pub stride: Vec<usize>,
    /// d_d (≥ 1).
    pub dilation: Vec<usize>,
    /// (lo_d, hi_d): zeros added before and after each axis.
    pub padding: Vec<(usize, usize)>,
    /// g (≥ 1): output channels of group j read only input channels of group j.
    pub groups: usize,
    /// S_d, the input's size on each spatial axis (≥ 1).
    pub input_size: Vec<usize>,
}

impl ConvGeometry {
    /// Spatial axes n.
    pub fn axes(&self) -> usize {
        self.kernel.len()
    }

    /// O_d = ⌊(S_d + lo_d + hi_d − d_d·(k_d − 1) − 1) / s_d⌋ + 1 on each axis, after checking
    /// that every list has n ≥ 1 entries, every size, stride and dilation is positive, every
    /// entry at most [`MAX_CONV_ENTRY`], and every O_d ≥ 1. Errors say what is wrong; the
    /// caller names the site.
    pub fn output_size(&self) -> Result<Vec<usize>> {
        let n = self.kernel.len();
        if n == 0 {
            bail!("`kernel` lists no spatial axis; a convolution has at least one");
        }
        let lists = [
            ("stride", self.stride.len()),
            ("dilation", self.dilation.len()),
            ("padding", self.padding.len()),
            ("the inputs' spatial axes", self.input_size.len()),
        ];
        for (what, len) in lists {
            if len != n {
                bail!("`kernel` has {n} spatial axes but {what} has {len}");
            }
        }
        let positive = [
            ("kernel", &self.kernel),
            ("stride", &self.stride),
            ("dilation", &self.dilation),
            ("input size", &self.input_size),
        ];
        for (what, v) in positive {
            if let Some(x) = v.iter().find(|&&x| x == 0 || x > MAX_CONV_ENTRY) {
                bail!("{what} {v:?} holds {x}; every entry must be in 1..={MAX_CONV_ENTRY}");
            }
        }
        if let Some(p) = self
            .padding
            .iter()
            .find(|p| p.0 > MAX_CONV_ENTRY || p.1 > MAX_CONV_ENTRY)
        {
            bail!("padding {p:?} is above {MAX_CONV_ENTRY}");
        }
        if self.groups == 0 || self.groups > MAX_CONV_ENTRY {
            bail!(
                "groups is {}; it must be in 1..={MAX_CONV_ENTRY}",
                self.groups
            );
        }
        (0..n)
            .map(|d| {
                // Every entry is at most 2³², so these fit in u128 without overflow.
                let padded = (self.input_size[d] + self.padding[d].0 + self.padding[d].1) as u128;
                let span = (self.dilation[d] as u128) * (self.kernel[d] as u128 - 1) + 1;
                if padded < span {
                    bail!(
                        "axis {d}: the padded input ({} + {} + {} = {padded}) is shorter than the dilated kernel ({} · ({} − 1) + 1 = {span}), so the output has no position (O_{d} < 1)",
                        self.input_size[d], self.padding[d].0, self.padding[d].1, self.dilation[d], self.kernel[d]
                    );
                }
                Ok(((padded - span) / self.stride[d] as u128) as usize + 1)
            })
            .collect()
    }

    /// P = ∏ O_d, the output positions; `None` when it overflows.
    pub fn positions(&self) -> Result<usize> {
        self.output_size()?
            .iter()
            .try_fold(1usize, |a, &o| a.checked_mul(o))
            .ok_or_else(|| crate::error::Error::new("the number of output positions overflows"))
    }

    /// ∏ k_d, the kernel's volume (checked by [`Self::output_size`] to be positive).
    pub fn kernel_volume(&self) -> usize {
        self.kernel.iter().product()
    }

    /// ∏ S_d, the input's spatial volume.
    pub fn input_volume(&self) -> usize {
        self.input_size.iter().product()
    }

    /// Per axis d, for each output coordinate o and kernel offset κ (index o·k_d + κ), the
    /// input coordinate it reads, or `None` where it reads padding: Σ_d O_d·k_d entries, so
    /// that an unfold never holds a table of P·∏k.
    fn axis_taps(&self) -> Vec<Vec<Option<usize>>> {
        let out = self.output_size().expect("a checked geometry");
        (0..self.axes())
            .map(|d| {
                let (k, s, dil, lo) = (
                    self.kernel[d],
                    self.stride[d],
                    self.dilation[d],
                    self.padding[d].0,
                );
                let size = self.input_size[d];
                (0..out[d])
                    .flat_map(|o| {
                        (0..k)
                            .map(move |kk| (o * s + kk * dil).checked_sub(lo).filter(|&x| x < size))
                    })
                    .collect()
            })
            .collect()
    }
}

/// The next multi-index in row-major order (the last axis fastest), wrapping to zeros.
fn advance(index: &mut [usize], sizes: &[usize]) {
    for d in (0..index.len()).rev() {
        index[d] += 1;
        if index[d] < sizes[d] {
            return;
        }
        index[d] = 0;
    }
}

/// A convolution weight site's input, every value once: B × C_in × ∏S, the spatial axes
/// flattened row-major, with the geometry that unfolds it; held as its site's other factors are
/// ([`Factors`]), and read an example (or a group's channels of one) at a time.
#[derive(Clone, Debug)]
pub struct ConvInput<F = Array3<f64>> {
    /// Kernel, stride, dilation, zero padding, groups and the input's spatial sizes.
    pub geometry: ConvGeometry,
    /// B × C_in × ∏S_d.
    pub inputs: F,
}

impl<F: Factors> ConvInput<F> {
    /// C_in.
    pub fn channels(&self) -> usize {
        self.inputs.dim().1
    }

    /// C_in/g · ∏k: the columns of the weight's gradient (and the width of an unfolded row).
    pub fn patch_width(&self) -> usize {
        self.channels() / self.geometry.groups * self.geometry.kernel_volume()
    }

    /// P · g: the rows of one example's unfolded factors.
    pub fn rows(&self) -> usize {
        self.geometry.positions().expect("a checked geometry") * self.geometry.groups
    }

    /// Example i's activations in the unfolded layout: (P·g) × (C_in/g · ∏k), row p·g + j
    /// group j's patch at output position p, zeros where the kernel reads padding.
    pub fn unfold(&self, i: usize) -> Array2<f64> {
        // Each value widened as it is copied: the example is never widened whole first.
        match self.inputs.held_example(i) {
            HeldExample::F32(x) => self.unfold_from(x),
            HeldExample::F64(x) => self.unfold_from(x),
        }
    }

    /// [`Self::unfold`] of one example's C_in × ∏S inputs `x`, held as `T`.
    fn unfold_from<T: Copy + Into<f64>>(&self, x: ArrayView2<T>) -> Array2<f64> {
        let geo = &self.geometry;
        let g = geo.groups;
        let cin_g = self.channels() / g;
        let k = geo.kernel_volume();
        let out = geo.output_size().expect("a checked geometry");
        let p_total: usize = out.iter().product();
        let axis_taps = geo.axis_taps();
        let n = geo.axes();
        // Row-major strides of the input's spatial axes.
        let mut strides = vec![1usize; n];
        for d in (0..n.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * geo.input_size[d + 1];
        }
        let width = cin_g * k;
        let x = x.as_standard_layout();
        let x = x.as_slice().expect("standard layout");
        let spatial = geo.input_volume();
        let mut result = Array2::<f64>::zeros((p_total * g, width));
        let dst = result.as_slice_mut().expect("a fresh array is contiguous");
        // The flat input index each kernel offset reads at the current position, or
        // `usize::MAX` where it reads padding (left zero).
        let mut taps = vec![usize::MAX; k];
        let mut pos = vec![0usize; n];
        let mut off = vec![0usize; n];
        for p in 0..p_total {
            off.iter_mut().for_each(|x| *x = 0);
            for tap in taps.iter_mut() {
                *tap = (0..n)
                    .try_fold(0usize, |flat, d| {
                        axis_taps[d][pos[d] * geo.kernel[d] + off[d]].map(|x| flat + x * strides[d])
                    })
                    .unwrap_or(usize::MAX);
                advance(&mut off, &geo.kernel);
            }
            // Each row written in order: channel c's k offsets, then channel c + 1's.
            for j in 0..g {
                let row = &mut dst[(p * g + j) * width..(p * g + j + 1) * width];
                for (c, cols) in row.chunks_exact_mut(k).enumerate() {
                    let channel = &x[(j * cin_g + c) * spatial..(j * cin_g + c + 1) * spatial];
                    for (v, &tap) in cols.iter_mut().zip(&taps) {
                        if tap != usize::MAX {
                            *v = channel[tap].into();
                        }
                    }
                }
            }
            advance(&mut pos, &out);
        }
        result
    }

    /// S_d + lo_d + hi_d per axis: the zero-padded input grid's sizes.
    fn padded_size(&self) -> Vec<usize> {
        let geo = &self.geometry;
        (0..geo.axes())
            .map(|d| geo.input_size[d] + geo.padding[d].0 + geo.padding[d].1)
            .collect()
    }

    /// ∏(S_d + lo_d + hi_d): the positions of the zero-padded input grid.
    pub fn padded_volume(&self) -> usize {
        self.padded_size().iter().product()
    }

    /// Example i's group j on the zero-padded grid: P̃ × C_in/g, row q the padded position q
    /// (row-major), zeros in the padding. Unfolded row p of group j reads exactly the rows
    /// `origin[p] + offset[k]` of it ([`Self::padded_taps`]), so two patches' dot product is
    /// Σ_k ⟨x̃_{origin[t] + offset[k]}, x̃_{origin[s] + offset[k]}⟩: a sum of entries of this
    /// grid's Gram, which a judge forms once instead of the patches' Gram over C_in/g·∏k.
    pub fn padded_group(&self, i: usize, j: usize) -> Array2<f64> {
        let geo = &self.geometry;
        let n = geo.axes();
        let cin_g = self.channels() / geo.groups;
        let padded = self.padded_size();
        let mut grid = Array2::<f64>::zeros((self.padded_volume(), cin_g));
        // Only group j's channels, widened: a depthwise convolution reads each once.
        let x = self.inputs.example_rows(i, j * cin_g..(j + 1) * cin_g);
        let mut at = vec![0usize; n];
        for flat in 0..geo.input_volume() {
            let q = (0..n).fold(0usize, |acc, d| acc * padded[d] + at[d] + geo.padding[d].0);
            for c in 0..cin_g {
                grid[(q, c)] = x[(c, flat)];
            }
            advance(&mut at, &geo.input_size);
        }
        grid
    }

    /// The padded grid's flat index of each output position's first tap (row-major over the
    /// output, as [`Self::unfold`]'s rows) and of each kernel offset relative to it (row-major
    /// over the kernel, as an unfolded row's columns within a channel).
    pub fn padded_taps(&self) -> (Vec<usize>, Vec<usize>) {
        let geo = &self.geometry;
        let n = geo.axes();
        let out = geo.output_size().expect("a checked geometry");
        let padded = self.padded_size();
        let flat = |index: &[usize], scale: &[usize]| {
            (0..n).fold(0usize, |acc, d| acc * padded[d] + index[d] * scale[d])
        };
        let mut origins = Vec::with_capacity(out.iter().product());
        let mut at = vec![0usize; n];
        for _ in 0..out.iter().product::<usize>() {
            origins.push(flat(&at, &geo.stride));
            advance(&mut at, &out);
        }
        let mut offsets = Vec::with_capacity(geo.kernel_volume());
        let mut k = vec![0usize; n];
        for _ in 0..geo.kernel_volume() {
            offsets.push(flat(&k, &geo.dilation));
            advance(&mut k, &geo.kernel);
        }
        (origins, offsets)
    }

    /// One example's backprops (P × C_out) in the unfolded layout: (P·g) × C_out, row p·g + j
    /// position p's gradient with every channel outside group j zeroed. Passed through for g = 1.
    pub fn spread_backprops<'a>(&self, bp: CowArray<'a, f64, Ix2>) -> CowArray<'a, f64, Ix2> {
        let g = self.geometry.groups;
        if g == 1 {
            return bp;
        }
        let (p_total, c_out) = bp.dim();
        let cout_g = c_out / g;
        let mut out = Array2::<f64>::zeros((p_total * g, c_out));
        for p in 0..p_total {
            for j in 0..g {
                let cols = j * cout_g..(j + 1) * cout_g;
                for o in cols {
                    out[(p * g + j, o)] = bp[(p, o)];
                }
            }
        }
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(kernel: &[usize], input: &[usize]) -> ConvGeometry {
        let n = kernel.len();
        ConvGeometry {
            kernel: kernel.to_vec(),
            stride: vec![1; n],
            dilation: vec![1; n],
            padding: vec![(0, 0); n],
            groups: 1,
            input_size: input.to_vec(),
        }
    }

    #[test]
    fn output_sizes_follow_torchs_formula() {
        // torch.nn.Conv1d(1, 1, 3, stride=2, padding=1, dilation=2) on 10: (10+2-4-1)//2+1 = 4.
        let mut g = geometry(&[3], &[10]);
        g.stride = vec![2];
        g.dilation = vec![2];
        g.padding = vec![(1, 1)];
        assert_eq!(g.output_size().unwrap(), vec![4]);
        // Asymmetric padding: (5 + 0 + 2 − 3) / 1 + 1 = 5.
        let mut g = geometry(&[3], &[5]);
        g.padding = vec![(0, 2)];
        assert_eq!(g.output_size().unwrap(), vec![5]);
    }

    #[test]
    fn impossible_geometries_are_refused() {
        let e = geometry(&[5], &[3]).output_size().unwrap_err().to_string();
        assert!(e.contains("O_0 < 1"), "{e}");
        let e = geometry(&[0], &[3]).output_size().unwrap_err().to_string();
        assert!(e.contains("kernel"), "{e}");
        let e = geometry(&[], &[]).output_size().unwrap_err().to_string();
        assert!(e.contains("no spatial axis"), "{e}");
        let mut g = geometry(&[1, 1], &[3, 3]);
        g.stride = vec![1];
        let e = g.output_size().unwrap_err().to_string();
        assert!(e.contains("stride has 1"), "{e}");
        let mut g = geometry(&[1], &[3]);
        g.groups = 0;
        assert!(g.output_size().is_err());
    }

    #[test]
    fn a_2d_unfold_reads_the_padded_window_at_each_position() {
        // 1 channel, 3×3 input holding 1..9, 2×2 kernel, padding (1, 0) on rows: output 3×2.
        let mut g = geometry(&[2, 2], &[3, 3]);
        g.padding = vec![(1, 0), (0, 0)];
        let inputs = Array3::from_shape_fn((1, 1, 9), |(_, _, s)| (s + 1) as f64);
        let c = ConvInput {
            geometry: g,
            inputs,
        };
        let u = c.unfold(0);
        assert_eq!(u.dim(), (6, 4));
        // Position (0, 0): the padded row above, then input row 0 columns 0..2.
        assert_eq!(u.row(0).to_vec(), vec![0.0, 0.0, 1.0, 2.0]);
        // Position (2, 1): input rows 1..3, columns 1..3.
        assert_eq!(u.row(5).to_vec(), vec![5.0, 6.0, 8.0, 9.0]);
    }

    #[test]
    fn grouped_backprops_keep_each_groups_channels_on_its_row() {
        let mut g = geometry(&[1], &[2]);
        g.groups = 2;
        let c = ConvInput {
            geometry: g,
            inputs: Array3::zeros((1, 2, 2)),
        };
        let bp = ndarray::array![[1.0, 2.0], [3.0, 4.0]];
        let spread = c.spread_backprops(bp.view().into());
        assert_eq!(
            spread.to_owned(),
            ndarray::array![[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]]
        );
    }
}
