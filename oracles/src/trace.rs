//! The per-site factors of a batch ("trace"): for every use of a parameter, what a ghost clipper
//! reads. The reference records them from its own forward/backward; `materialized_norms`
//! rebuilds every per-example gradient from them by brute force.

use crate::conv::ConvInput;
use crate::error::{bail, Result};
use crate::factors::{Factors, StoredFactors};
use crate::matmul::{product_into, Accumulate};
use crate::precision::Precision;
use crate::site::{SiteKind, SiteSpec};
use crate::trace_shape::{validate_shapes, ConvShape, IdAt, SiteShape};
use ndarray::{s, Array2, Array3, Axis, CowArray, Ix2};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::Range;

/// One example's factors at one site (its R rows).
#[derive(Clone, Debug)]
pub struct SiteRecord {
    pub name: String,
    pub param: String,
    pub kind: SiteKind,
    pub vocab: Option<usize>,
    pub activations: Option<Array2<f64>>,
    pub ids: Option<Vec<usize>>,
    pub backprops: Array2<f64>,
}

impl SiteRecord {
    pub fn dense(
        name: String,
        kind: SiteKind,
        activations: Array2<f64>,
        backprops: Array2<f64>,
    ) -> Self {
        SiteRecord {
            param: name.clone(),
            name,
            kind,
            vocab: None,
            activations: Some(activations),
            ids: None,
            backprops,
        }
    }

    pub fn bias(name: String, backprops: Array2<f64>) -> Self {
        SiteRecord {
            param: name.clone(),
            name,
            kind: SiteKind::Bias,
            vocab: None,
            activations: None,
            ids: None,
            backprops,
        }
    }

    pub fn embedding(
        name: String,
        param: String,
        vocab: usize,
        ids: Vec<usize>,
        backprops: Array2<f64>,
    ) -> Self {
        SiteRecord {
            name,
            param,
            kind: SiteKind::Embedding,
            vocab: Some(vocab),
            activations: None,
            ids: Some(ids),
            backprops,
        }
    }

    pub fn spec(&self) -> SiteSpec {
        SiteSpec {
            name: self.name.clone(),
            param: self.param.clone(),
            kind: self.kind,
            vocab: self.vocab,
        }
    }
}

/// A batch's factors, B×R leading, R each site's own rows per example, held as `F`: f64 for the
/// reference's own traces, the stored precision for a trace file's ([`Factors`]).
#[derive(Clone, Debug)]
pub struct Site<F = Array3<f64>> {
    /// Name, parameter and kind.
    pub spec: SiteSpec,
    /// B×R×in (linear, conv1d; for layernorm the normalized input x̂). `None` for a
    /// convolution stored as its input ([`Site::conv`]).
    pub activations: Option<F>,
    /// B×R ids (embedding).
    pub ids: Option<Array2<i64>>,
    /// B×R×out: gradient of each example's own loss with respect to the site's output; for a
    /// convolution stored as its input, B×P×C_out (its output positions).
    pub backprops: F,
    /// A convolution's weight (kind `linear`) stored as the convolution's input and geometry
    /// (format /2), each input value once, instead of unfolded `activations`. Read it through
    /// [`Site::rows`], which unfolds one example at a time.
    pub conv: Option<ConvInput<F>>,
}

/// One example's factors at a site in the row form every kind's gradient is written from
/// (Σ_r backprops_r ⊗ activations_r in the parameter's layout): borrowed from a row-form site,
/// unfolded for a convolution stored as its input.
#[derive(Debug)]
pub struct SiteRows<'a> {
    /// R×in (linear, conv1d, layernorm); `None` for the kinds without activations.
    pub activations: Option<CowArray<'a, f64, Ix2>>,
    /// R×out.
    pub backprops: CowArray<'a, f64, Ix2>,
}

impl<F: Factors> Site<F> {
    /// Example `i`'s factors as R rows ([`SiteRows`]): the only way the reference and the judge
    /// read a site's activations and backprops, so a convolution stored as its input (unfolded
    /// here, one example at a time, into the /1 layout: rows (position, group), the other
    /// groups' channels of the backprops zeroed) gives every consumer exactly the factors of
    /// its unfolded twin.
    pub fn rows(&self, i: usize) -> SiteRows<'_> {
        let bp = self.backprops.example(i);
        match &self.conv {
            None => SiteRows {
                activations: self.activations.as_ref().map(|a| a.example(i)),
                backprops: bp,
            },
            Some(c) => SiteRows {
                activations: Some(c.unfold(i).into()),
                backprops: c.spread_backprops(bp),
            },
        }
    }

    /// Example `i`'s factors as [`Site::rows`] gives them, with the side whose columns index the
    /// gradient's rows in the parameter's layout (the backprops of a linear, bias or layernorm
    /// site, both of a layernorm's, the activations of a conv1d) cut to the columns `block`:
    /// what one block of rows of the gradient reads, so that a gradient rebuilt a block at a time
    /// widens each example's values once over all its blocks, not once a block. An embedding's
    /// backprops, scattered by id, stay whole.
    pub fn block_rows(&self, i: usize, block: Range<usize>) -> SiteRows<'_> {
        let (cut_bp, cut_act) = match self.spec.kind {
            SiteKind::Linear | SiteKind::Bias => (true, false),
            SiteKind::LayerNorm => (true, true),
            SiteKind::Conv1d => (false, true),
            SiteKind::Embedding => (false, false),
        };
        fn read<F: Factors>(f: &F, i: usize, cols: Option<Range<usize>>) -> CowArray<'_, f64, Ix2> {
            match cols {
                Some(cols) => f.example_cols(i, cols),
                None => f.example(i),
            }
        }
        let cols = |cut: bool| cut.then(|| block.clone());
        match &self.conv {
            // A grouped convolution's backprops are spread over its groups' rows first.
            Some(c) if c.geometry.groups > 1 => {
                let rows = self.rows(i);
                let cut = |a: CowArray<'static, f64, Ix2>| a.slice_move(s![.., block.clone()]);
                let bp = rows.backprops.into_owned().into();
                SiteRows {
                    activations: rows.activations.map(|a| a.into_owned().into()),
                    backprops: if cut_bp { cut(bp) } else { bp },
                }
            }
            Some(c) => SiteRows {
                activations: Some(c.unfold(i).into()),
                backprops: read(&self.backprops, i, cols(cut_bp)),
            },
            None => SiteRows {
                activations: self.activations.as_ref().map(|a| read(a, i, cols(cut_act))),
                backprops: read(&self.backprops, i, cols(cut_bp)),
            },
        }
    }

    /// R, the rows of one example's factors as [`Site::rows`] gives them: P·g for a
    /// convolution stored as its input.
    pub fn row_count(&self) -> usize {
        match &self.conv {
            None => self.backprops.dim().1,
            Some(c) => c.rows(),
        }
    }

    /// The rows an entry of the site's gradient sums over: R, or P for a convolution stored as
    /// its input (of its P·g rows only the P of an entry's group are not zero).
    pub fn accumulation_length(&self) -> usize {
        self.backprops.dim().1
    }

    /// The width of a row's activations (C_in/g·∏k for a convolution stored as its input);
    /// `None` for the kinds without activations.
    pub fn input_width(&self) -> Option<usize> {
        match &self.conv {
            None => self.activations.as_ref().map(|a| a.dim().2),
            Some(c) => Some(c.patch_width()),
        }
    }

    /// The site's factors as dimensions ([`SiteShape`]).
    pub fn shape(&self) -> SiteShape<'_> {
        SiteShape {
            spec: &self.spec,
            backprops: self.backprops.shape(),
            activations: self.activations.as_ref().map(|a| a.shape()),
            ids: self.ids.as_ref().map(|i| i.shape()),
            id_range: self
                .ids
                .as_ref()
                .and_then(|i| IdAt::extremes(i.iter().copied(), i.ncols())),
            conv: self.conv.as_ref().map(|c| ConvShape {
                geometry: &c.geometry,
                inputs: c.inputs.shape(),
            }),
        }
    }
}

/// A parameter more than one site writes, with those sites' names and kinds: its gradient is
/// the sum of their gradients, and its norm has their cross terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiedParameter {
    /// The shared parameter's name.
    pub param: String,
    /// (site name, kind) of every site that writes it, in trace order.
    pub sites: Vec<(String, SiteKind)>,
}

/// A batch's per-site factors: what a clipper computes per-example norms from, held as `F`
/// (f64 for the reference's own traces, the stored precision for a trace file's).
#[derive(Clone, Debug)]
pub struct Trace<F = Array3<f64>> {
    /// The sites, in forward order.
    pub sites: Vec<Site<F>>,
}

/// A trace file's factors, each tensor in the precision it is stored in.
pub type StoredTrace = Trace<StoredFactors>;

impl StoredTrace {
    /// Every factor widened to f64 (exactly), a tensor at a time.
    pub fn into_f64(self) -> Trace {
        Trace {
            sites: self
                .sites
                .into_iter()
                .map(|s| Site {
                    spec: s.spec,
                    activations: s.activations.map(StoredFactors::into_f64),
                    ids: s.ids,
                    backprops: s.backprops.into_f64(),
                    conv: s.conv.map(|c| ConvInput {
                        geometry: c.geometry,
                        inputs: c.inputs.into_f64(),
                    }),
                })
                .collect(),
        }
    }
}

/// Stacks a batch's site records into a [`Trace`] as they arrive, one example at a time, so a
/// large model's factors are held once (never as records and as stacked arrays together).
#[derive(Debug)]
pub(crate) struct TraceBuilder {
    batch: usize,
    sites: Vec<Site>,
}

impl TraceBuilder {
    pub(crate) fn new(batch: usize) -> Self {
        TraceBuilder {
            batch,
            sites: Vec::new(),
        }
    }

    /// Example `i`'s records; every example lists the same sites in the same order and shapes.
    pub(crate) fn push(&mut self, i: usize, records: Vec<SiteRecord>) {
        if self.sites.is_empty() {
            let b = self.batch;
            self.sites = records
                .iter()
                .map(|r| Site {
                    spec: r.spec(),
                    activations: r
                        .activations
                        .as_ref()
                        .map(|a| Array3::zeros((b, a.nrows(), a.ncols()))),
                    ids: r.ids.as_ref().map(|ids| Array2::zeros((b, ids.len()))),
                    backprops: Array3::zeros((b, r.backprops.nrows(), r.backprops.ncols())),
                    conv: None,
                })
                .collect();
        }
        assert_eq!(
            records.len(),
            self.sites.len(),
            "every example records the same sites"
        );
        for (site, r) in self.sites.iter_mut().zip(records) {
            site.backprops.slice_mut(s![i, .., ..]).assign(&r.backprops);
            if let (Some(dst), Some(a)) = (site.activations.as_mut(), r.activations.as_ref()) {
                dst.slice_mut(s![i, .., ..]).assign(a);
            }
            if let (Some(dst), Some(ids)) = (site.ids.as_mut(), r.ids.as_ref()) {
                for (t, &x) in ids.iter().enumerate() {
                    dst[(i, t)] = x as i64;
                }
            }
        }
    }

    pub(crate) fn finish(self) -> Trace {
        Trace { sites: self.sites }
    }
}

impl Trace {
    /// The trace with every factor rounded to `precision`: what a clipper in that precision
    /// reads, exactly, as f64 values.
    pub fn rounded(&self, precision: Precision) -> Trace {
        let round = |a: &Array3<f64>| a.mapv(|x| precision.round(x));
        Trace {
            sites: self
                .sites
                .iter()
                .map(|s| Site {
                    spec: s.spec.clone(),
                    activations: s.activations.as_ref().map(round),
                    ids: s.ids.clone(),
                    backprops: round(&s.backprops),
                    conv: s.conv.as_ref().map(|c| ConvInput {
                        geometry: c.geometry.clone(),
                        inputs: round(&c.inputs),
                    }),
                })
                .collect(),
        }
    }
}

impl<F: Factors> Trace<F> {
    /// Examples in the batch (0 for a trace without sites).
    pub fn batch_size(&self) -> usize {
        self.sites.first().map_or(0, |s| s.backprops.dim().0)
    }

    /// Parameters in first-use order, each with the indices of its sites.
    pub fn params(&self) -> Vec<(String, Vec<usize>)> {
        let mut order: Vec<(String, Vec<usize>)> = Vec::new();
        for (j, site) in self.sites.iter().enumerate() {
            match order.iter_mut().find(|(p, _)| *p == site.spec.param) {
                Some((_, v)) => v.push(j),
                None => order.push((site.spec.param.clone(), vec![j])),
            }
        }
        order
    }

    /// The parameters written by more than one site (a tied embedding and LM head), in
    /// first-use order, each with its sites in the trace's order.
    pub fn tied_parameters(&self) -> Vec<TiedParameter> {
        self.params()
            .into_iter()
            .filter(|(_, js)| js.len() > 1)
            .map(|(param, js)| TiedParameter {
                param,
                sites: js
                    .iter()
                    .map(|&j| (self.sites[j].spec.name.clone(), self.sites[j].spec.kind))
                    .collect(),
            })
            .collect()
    }

    /// Every site's factors as dimensions.
    pub fn shapes(&self) -> Vec<SiteShape<'_>> {
        self.sites.iter().map(Site::shape).collect()
    }

    /// The factors fit together and every site of a parameter writes one gradient shape
    /// ([`validate_shapes`]): what materializing the gradients assumes.
    pub fn validate(&self) -> Result<()> {
        validate_shapes(&self.shapes())
    }

    /// (rows, cols) of the gradient site `j` writes, in its parameter's layout.
    pub fn site_gradient_shape(&self, j: usize) -> (usize, usize) {
        let site = &self.sites[j];
        let input = site.input_width().unwrap_or(0);
        site.spec
            .kind
            .gradient_shape(site.backprops.dim().2, input, site.spec.vocab)
    }

    /// Example `i`'s gradient at site `j`, materialized in the parameter's layout.
    pub fn site_gradient(&self, j: usize, i: usize) -> Result<Array2<f64>> {
        let (rows, cols) = self.site_gradient_shape(j);
        let mut weights = vec![0.0; self.batch_size()];
        weights[i] = 1.0;
        let mut g = Array2::zeros((rows, cols));
        self.add_site_gradient_rows(j, &weights, 0..rows, &mut g)?;
        Ok(g)
    }

    /// Adds Σ_i w_i·(example i's gradient at site `j`), rows `rows` of the parameter's layout,
    /// into `out` (rows.len() × cols). Examples of weight 0 are skipped. Only a block of rows is
    /// ever materialized, so a judge can rebuild a vocabulary-sized gradient in bounded memory.
    pub fn add_site_gradient_rows(
        &self,
        j: usize,
        weights: &[f64],
        rows: Range<usize>,
        out: &mut Array2<f64>,
    ) -> Result<()> {
        let site = &self.sites[j];
        for (i, &w) in weights.iter().enumerate() {
            if w == 0.0 {
                continue;
            }
            // The side the parameter's rows index comes cut to `rows` already.
            let factors = site.block_rows(i, rows.clone());
            let bp = factors.backprops.view();
            let act = |_: usize| {
                factors
                    .activations
                    .as_ref()
                    .map(|a| a.view())
                    .expect("a linear, conv1d or layernorm site has activations")
            };
            match site.spec.kind {
                SiteKind::Linear => {
                    product_into(w, bp.t(), act(i), Accumulate::Add, out.view_mut())
                }
                SiteKind::Conv1d => {
                    product_into(w, act(i).t(), bp, Accumulate::Add, out.view_mut())
                }
                SiteKind::Bias => {
                    let sums = bp.sum_axis(Axis(0));
                    out.column_mut(0).scaled_add(w, &sums);
                }
                SiteKind::LayerNorm => {
                    let prod = &bp * &act(i);
                    out.column_mut(0).scaled_add(w, &prod.sum_axis(Axis(0)));
                }
                SiteKind::Embedding => {
                    let vocab = site.spec.vocab.expect("embedding site has a vocabulary");
                    let ids = site.ids.as_ref().expect("embedding site has ids");
                    for (r, &x) in ids.row(i).iter().enumerate() {
                        if x < 0 || x as usize >= vocab {
                            bail!(
                                "site `{}`: id {x} at example {i}, row {r} is outside 0..{vocab}",
                                site.spec.name
                            );
                        }
                        let x = x as usize;
                        if rows.contains(&x) {
                            out.row_mut(x - rows.start).scaled_add(w, &bp.row(r));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Per-example squared norms by brute force: every site's gradient materialized, sites that
    /// share a parameter summed, then the squared Frobenius norm. Returns, per example, the total
    /// and for every parameter with more than one site the matrix of site inner products.
    pub fn materialized_norms(&self) -> Result<Vec<MaterializedNorm>> {
        self.validate()?;
        let params = self.params();
        let mut out = Vec::with_capacity(self.batch_size());
        for i in 0..self.batch_size() {
            let mut total = 0.0;
            let mut per_param = BTreeMap::new();
            let mut shared = BTreeMap::new();
            for (param, js) in &params {
                let grads: Vec<Array2<f64>> = js
                    .iter()
                    .map(|&j| self.site_gradient(j, i))
                    .collect::<Result<_>>()?;
                let sum = grads
                    .iter()
                    .skip(1)
                    .fold(grads[0].clone(), |acc, g| acc + g);
                let sq = sum.iter().map(|v| v * v).sum::<f64>();
                total += sq;
                per_param.insert(param.clone(), sq);
                if grads.len() > 1 {
                    let inner = grads
                        .iter()
                        .map(|a| grads.iter().map(|b| (a * b).sum()).collect())
                        .collect();
                    shared.insert(param.clone(), inner);
                }
            }
            out.push(MaterializedNorm {
                total_sq: total,
                per_param_sq: per_param,
                shared_inner: shared,
            });
        }
        Ok(out)
    }
}

#[derive(Clone, Debug)]
pub struct MaterializedNorm {
    pub total_sq: f64,
    pub per_param_sq: BTreeMap<String, f64>,
    /// For a parameter with k sites: the k×k matrix ⟨G_j, G_l⟩.
    pub shared_inner: BTreeMap<String, Vec<Vec<f64>>>,
}
