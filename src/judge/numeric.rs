//! The arithmetic the judge's figures share, below every figure: a ratio that is undefined
//! rather than infinite, a maximum that NaN wins, the batch Gram's bilinear form, and solving
//! with that Gram.

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt_pivoting::factor as pivoted_llt;
use faer::{Mat, Par};

/// The larger of two values, NaN winning: a NaN metric must show, never vanish into a max.
pub(crate) fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// x / y where both are finite and y is not zero.
pub(crate) fn ratio(x: f64, y: f64) -> Option<f64> {
    (y != 0.0 && x.is_finite() && y.is_finite()).then(|| x / y)
}

/// aᵀGb = Σ_ik a_i G_ik b_k for the batch's Gram G_ik = ⟨g_i*, g_k*⟩: ⟨Σ a_i g_i*, Σ b_k g_k*⟩
/// without materializing either sum (aᵀGa is ‖Σ a_i g_i*‖²).
pub(crate) fn bilinear(gram: &[Vec<f64>], a: &[f64], b: &[f64]) -> f64 {
    let mut s = 0.0;
    for (ai, row) in a.iter().zip(gram) {
        for (g, bk) in row.iter().zip(b) {
            s += ai * g * bk;
        }
    }
    s
}

/// Pivots of the Gram's Cholesky factor at or below this fraction of its largest diagonal are
/// dropped: the directions a nearly dependent batch (two identical examples) leaves undefined.
const DROPPED_PIVOT: f64 = 1e-12;

/// The symmetric positive semi-definite Gram G, factored once to solve G c = b for many b:
/// faer's Cholesky factorization with diagonal pivoting, P G Pᵀ = L Lᵀ, cut at the first pivot
/// L_jj² at or below [`DROPPED_PIVOT`] of G's largest diagonal. On the leading `rank` directions
/// the solve is exact (to rounding); the others get 0.
pub(crate) struct GramSolver {
    /// L in its lower triangle (only the leading `rank` columns are used).
    factor: Mat<f64>,
    /// Row k of P G Pᵀ is row `perm[k]` of G.
    perm: Vec<usize>,
    rank: usize,
}

impl GramSolver {
    pub(crate) fn new(gram: &[Vec<f64>]) -> Self {
        let n = gram.len();
        let mut factor = Mat::from_fn(n, n, |i, k| gram[i][k]);
        let mut perm = vec![0usize; n];
        let mut perm_inv = vec![0usize; n];
        let mut scratch = MemBuffer::new(pivoted_llt::cholesky_in_place_scratch::<usize, f64>(
            n,
            Par::Seq,
            Default::default(),
        ));
        let factored = pivoted_llt::cholesky_in_place(
            factor.as_mut(),
            &mut perm,
            &mut perm_inv,
            Par::Seq,
            MemStack::new(&mut scratch),
            Default::default(),
        )
        .map(|(info, _)| info.rank);
        // A NaN or negative diagonal leaves nothing to solve with.
        let rank = match factored {
            Ok(rank) => {
                let largest = (0..n).map(|i| gram[i][i].abs()).fold(0.0, f64::max);
                (0..rank)
                    .find(|&j| {
                        let pivot = factor[(j, j)] * factor[(j, j)];
                        pivot.is_nan() || pivot <= DROPPED_PIVOT * largest
                    })
                    .unwrap_or(rank)
            }
            Err(_) => 0,
        };
        GramSolver { factor, perm, rank }
    }

    /// How many directions the solve keeps: the batch's size where G is regular.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// c with G c = b on the kept directions, 0 on the dropped ones.
    pub(crate) fn solve(&self, b: &[f64]) -> Vec<f64> {
        let (l, r) = (&self.factor, self.rank);
        // L y = P b, then Lᵀ x = y, on the leading r×r block.
        let mut y: Vec<f64> = self.perm[..r].iter().map(|&i| b[i]).collect();
        for k in 0..r {
            let s: f64 = (0..k).map(|j| l[(k, j)] * y[j]).sum();
            y[k] = (y[k] - s) / l[(k, k)];
        }
        for k in (0..r).rev() {
            let s: f64 = (k + 1..r).map(|j| l[(j, k)] * y[j]).sum();
            y[k] = (y[k] - s) / l[(k, k)];
        }
        let mut out = vec![0.0; b.len()];
        for (k, v) in y.into_iter().enumerate() {
            out[self.perm[k]] = v;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ghost_oracle_reference::SplitMix64;

    /// G = AᵀA for an m×n A of seeded normals: rank min(m, n).
    fn gram_of(m: usize, n: usize, seed: u64) -> Vec<Vec<f64>> {
        let mut rng = SplitMix64::new(seed);
        let a: Vec<Vec<f64>> = (0..m)
            .map(|_| (0..n).map(|_| rng.normal()).collect())
            .collect();
        (0..n)
            .map(|i| {
                (0..n)
                    .map(|k| (0..m).map(|r| a[r][i] * a[r][k]).sum())
                    .collect()
            })
            .collect()
    }

    fn times(gram: &[Vec<f64>], c: &[f64]) -> Vec<f64> {
        gram.iter()
            .map(|row| row.iter().zip(c).map(|(g, c)| g * c).sum())
            .collect()
    }

    fn norm(v: &[f64]) -> f64 {
        v.iter().map(|x| x * x).sum::<f64>().sqrt()
    }

    #[test]
    fn a_regular_gram_is_solved_exactly() {
        // [[4, 2], [2, 3]]⁻¹ = [[3, −2], [−2, 4]] / 8.
        let s = GramSolver::new(&[vec![4.0, 2.0], vec![2.0, 3.0]]);
        assert_eq!(s.rank(), 2);
        let c = s.solve(&[1.0, 1.0]);
        assert!(
            (c[0] - 1.0 / 8.0).abs() < 1e-15 && (c[1] - 2.0 / 8.0).abs() < 1e-15,
            "{c:?}"
        );

        let gram = gram_of(9, 6, 3);
        let want = [0.5, -1.0, 2.0, 0.0, 0.25, 1.5];
        let s = GramSolver::new(&gram);
        assert_eq!(s.rank(), 6);
        let c = s.solve(&times(&gram, &want));
        for (c, w) in c.iter().zip(want) {
            assert!((c - w).abs() < 1e-9, "{c} vs {w}");
        }
    }

    #[test]
    fn a_rank_deficient_gram_keeps_its_range_and_solves_on_it() {
        for (m, n, seed) in [(2, 5, 1), (4, 6, 2), (1, 3, 4)] {
            let gram = gram_of(m, n, seed);
            let s = GramSolver::new(&gram);
            assert_eq!(s.rank(), m, "{m}×{n}");
            // b in G's range: the residual ‖G c − b‖ is rounding.
            let b = times(&gram, &(0..n).map(|i| 1.0 + i as f64).collect::<Vec<_>>());
            let c = s.solve(&b);
            let residual: Vec<f64> = times(&gram, &c)
                .iter()
                .zip(&b)
                .map(|(x, y)| x - y)
                .collect();
            assert!(norm(&residual) <= 1e-10 * norm(&b), "{m}×{n}: {residual:?}");
            assert_eq!(c.iter().filter(|v| **v == 0.0).count(), n - m);
        }
        // Two identical examples: one direction is undefined.
        let mut gram = gram_of(5, 3, 9);
        for row in gram.iter_mut() {
            row.push(row[0]);
        }
        gram.push(gram[0].clone());
        let s = GramSolver::new(&gram);
        assert_eq!(s.rank(), 3);
        let b = times(&gram, &[1.0, 2.0, 3.0, 4.0]);
        let c = s.solve(&b);
        let residual: Vec<f64> = times(&gram, &c)
            .iter()
            .zip(&b)
            .map(|(x, y)| x - y)
            .collect();
        assert!(norm(&residual) <= 1e-10 * norm(&b), "{residual:?}");
        // The duplicated pair carries their summed weight 1 + 4 between them.
        assert!((c[0] + c[3] - 5.0).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn a_zero_or_nan_gram_solves_to_nothing() {
        let s = GramSolver::new(&[vec![0.0, 0.0], vec![0.0, 0.0]]);
        assert_eq!((s.rank(), s.solve(&[1.0, 2.0])), (0, vec![0.0, 0.0]));
        let s = GramSolver::new(&[vec![f64::NAN, 0.0], vec![0.0, 1.0]]);
        assert_eq!((s.rank(), s.solve(&[1.0, 2.0])), (0, vec![0.0, 0.0]));
    }

    #[test]
    fn the_bilinear_form_is_the_inner_product_of_the_sums() {
        // Gradients g_0 = (1, 2), g_1 = (3, −1): G = [[5, 1], [1, 10]].
        let g = [[1.0, 2.0], [3.0, -1.0]];
        let gram: Vec<Vec<f64>> = (0..2)
            .map(|i| {
                (0..2)
                    .map(|k| g[i][0] * g[k][0] + g[i][1] * g[k][1])
                    .collect()
            })
            .collect();
        let (a, b) = ([2.0, -1.0], [0.5, 3.0]);
        let sa = [
            a[0] * g[0][0] + a[1] * g[1][0],
            a[0] * g[0][1] + a[1] * g[1][1],
        ];
        let sb = [
            b[0] * g[0][0] + b[1] * g[1][0],
            b[0] * g[0][1] + b[1] * g[1][1],
        ];
        assert_eq!(bilinear(&gram, &a, &b), sa[0] * sb[0] + sa[1] * sb[1]);
    }

    #[test]
    fn ratio_and_max_keep_undefined_values_visible() {
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(ratio(f64::INFINITY, 2.0), None);
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
        assert!(nan_max(1.0, f64::NAN).is_nan() && nan_max(f64::NAN, 1.0).is_nan());
        assert_eq!(nan_max(1.0, 2.0), 2.0);
    }
}
