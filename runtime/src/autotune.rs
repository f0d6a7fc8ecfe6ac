//! Autotuning the forward kernel: time every candidate tile configuration
//! on the caller's buffers, keep the fastest per (spec, shape class), and
//! remember it in memory and in the disk cache's `tuning/` records.
//!
//! A forward launch asks memory first (one read lock, no allocation), then,
//! once per (spec, shape class) and runtime, the disk; what it finds, or
//! that there is nothing, is cached in memory, so the launch path never
//! touches a file twice. Without a remembered choice it uses
//! [`tile_choice::preferred`](crate::tile_choice::preferred).
//!
//! Remembering and keeping the fastest (`remembered`, `keep_fastest`) serve
//! the backward's dK/dV tiles too (`autotune_backward`), in a table and
//! records of their own.

use crate::args::ArgValue;
use crate::choices::{Choice, Choices};
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::{ForwardIo, ForwardLaunch, ForwardOptions};
use crate::runtime::Runtime;
use crate::timing::median_ms;
use crate::tuning::{Candidate, Pass, Record, ShapeClass, TuningKey};
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::{to_source, Shape, Spec, CODEGEN_VERSION};
use std::fmt;

/// Untimed launches per candidate, after all candidates were loaded.
const WARMUP: usize = 2;
/// Timed launches per candidate; the median counts.
const RUNS: usize = 7;

/// What [`Runtime::autotune`] (forward tile configurations) or
/// [`Runtime::autotune_backward`] (dK/dV tiles) measured and chose.
#[derive(Debug)]
pub struct TuneReport<C = TileConfig> {
    /// The spec's name.
    pub spec: String,
    pub class: ShapeClass,
    /// The fastest candidate, now remembered for the class.
    pub best: C,
    /// Every candidate in order ([`tile_choice::candidates`](crate::tile_choice::candidates),
    /// [`Runtime::backward_candidates`]) with its median milliseconds, or
    /// why it could not run (e.g. too much shared memory). Empty for a
    /// launch with nothing to compute (nothing timed, nothing remembered).
    pub candidates: Vec<(C, Result<f64, Error>)>,
}

/// `class: best NAME | NAME 0.123 ms, NAME failed (why), …`
impl<C: Candidate> fmt::Display for TuneReport<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: best {} |", self.class, self.best.name())?;
        for (i, (config, ms)) in self.candidates.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            match ms {
                Ok(ms) => write!(f, "{sep}{} {ms:.3} ms", config.name())?,
                // An NVRTC error carries the whole source: its first line says enough.
                Err(e) => write!(f, "{sep}{} failed ({})", config.name(), first_line(e))?,
            }
        }
        Ok(())
    }
}

fn first_line(e: &Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

impl Runtime {
    /// Times every candidate tile configuration of `spec`
    /// ([`tile_choice::candidates`](crate::tile_choice::candidates) for [`Runtime::target`]) on these
    /// operands — all loaded first, compiled in parallel where not cached
    /// ([`Runtime::load_forwards`]), then one after another two untimed
    /// launches and the median of seven CUDA-event timings — and remembers
    /// the fastest for the launch's [`ShapeClass`], in memory and (unless
    /// `FLASHGEN_CACHE=off`) in the disk cache, where later runtimes find
    /// it. Later forward launches of the class use it.
    ///
    /// This is a forward pass: it overwrites O and the LSE (with the result
    /// of the last candidate that ran), and it waits for the GPU. A candidate
    /// that fails to compile or launch is reported in the
    /// [`TuneReport`] and skipped; only if all fail is it an error
    /// ([`Error::Tuning`]). `opts.config` is ignored.
    pub fn autotune<T: Element>(
        &self,
        spec: &Spec,
        io: ForwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<TuneReport, Error> {
        let (q, k) = (io.q.1, io.k.1);
        let shape = Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: q.seq, kv_len: k.seq };
        // The spec `forward` launches with these arguments.
        let bounded = self.bounded_spec(spec, args, opts);
        match ForwardLaunch::check(spec, bounded.as_deref(), io, args, opts)? {
            Some(mut launch) => self.tune(&mut launch, opts),
            None => Ok(TuneReport {
                spec: spec.name.clone(),
                class: self.shape_class(spec, &shape),
                best: crate::tile_choice::preferred_for(spec, self.target(), shape.kv_len),
                candidates: Vec::new(),
            }),
        }
    }

    /// The shape class of a launch of `spec` at `shape` on this GPU.
    pub fn shape_class(&self, spec: &Spec, shape: &Shape) -> ShapeClass {
        ShapeClass::new(spec, shape, self.sm_count())
    }

    /// The configuration autotuning chose for launches of `spec` at `shape`'s
    /// class (remembered by this runtime or found in the disk cache), if any.
    pub fn tuned_config(&self, spec: &Spec, shape: &Shape) -> Option<TileConfig> {
        let choice = self.choice(spec, self.shape_class(spec, shape));
        choice.tuned.then_some(choice.config)
    }

    /// `config` if it is a candidate of `spec` here: only those are known to
    /// compile for the target and are tested for exactness (other tile
    /// shapes or MMA kinds may be invalid for the spec or the GPU).
    pub(crate) fn candidate(&self, spec: &Spec, config: TileConfig) -> Result<TileConfig, Error> {
        if crate::tile_choice::candidates(spec, self.target()).contains(&config) {
            Ok(config)
        } else {
            Err(Error::NotACandidate { config: config.name(), spec: spec.name.clone(), arch: self.arch() })
        }
    }

    /// The configuration of a forward launch without one given: tuned first
    /// if the class has no choice yet and tuning on launch is on.
    pub(crate) fn config_for<T: Element>(
        &self,
        launch: &mut ForwardLaunch<'_, '_, T>,
        opts: &ForwardOptions<'_>,
    ) -> Result<TileConfig, Error> {
        let choice = self.choice(launch.spec, self.shape_class(launch.spec, &launch.shape));
        if !choice.tuned && self.autotune_launches {
            return self.tune(launch, opts).map(|report| report.best);
        }
        Ok(choice.config)
    }

    /// The class's choice from memory, else from the disk (then remembered
    /// in memory, found or not): the spec is printed, for the record's
    /// name, once per class and runtime.
    fn choice(&self, spec: &Spec, class: ShapeClass) -> Choice {
        let untuned = || crate::tile_choice::preferred_for(spec, self.target(), class.kv_len_bound());
        let candidates = || crate::tile_choice::candidates(spec, self.target());
        self.remembered((Pass::Forward, &self.choices), spec, class, candidates, untuned)
    }

    /// `choices`' choice of `class` of `spec`, else the disk's record for
    /// `pass` among `candidates()` (then remembered in memory), else
    /// `untuned()`, remembered as such.
    pub(crate) fn remembered<C: Candidate>(
        &self,
        (pass, choices): (Pass, &Choices<C>),
        spec: &Spec,
        class: ShapeClass,
        candidates: impl FnOnce() -> Vec<C>,
        untuned: impl FnOnce() -> C,
    ) -> Choice<C> {
        if let Some(choice) = choices.get(spec, class) {
            return choice;
        }
        let key = TuningKey::new(pass, &to_source(spec), class, self.arch(), CODEGEN_VERSION);
        let choice = match self.disk.as_ref().and_then(|disk| disk.load_tuning(key, &candidates())) {
            Some(config) => Choice { config, tuned: true },
            None => Choice { config: untuned(), tuned: false },
        };
        choices.keep_first(spec, class, choice)
    }

    /// Loads every candidate at once, times them one after another on
    /// `launch` and remembers the fastest.
    pub(crate) fn tune<T: Element>(
        &self,
        launch: &mut ForwardLaunch<'_, '_, T>,
        opts: &ForwardOptions<'_>,
    ) -> Result<TuneReport, Error> {
        let spec = launch.spec;
        let class = self.shape_class(spec, &launch.shape);
        let configs = crate::tile_choice::candidates(spec, self.target());
        let which: Vec<_> = configs.iter().map(|&config| launch.which(self, config)).collect();
        let loads = self.load_all(spec, &which);
        // A failed load is not cached: launching that candidate would compile it again.
        let candidates: Vec<(TileConfig, Result<f64, Error>)> = configs
            .into_iter()
            .zip(loads)
            .map(|(config, loaded)| {
                let ms = loaded.and_then(|_| median_ms(self.stream(), WARMUP, RUNS, || launch.run(self, config, opts)));
                (config, ms)
            })
            .collect();
        self.keep_fastest((Pass::Forward, &self.choices), spec, class, candidates)
    }

    /// The fastest of `candidates`, timed on a launch of `spec` in `class`:
    /// remembered in `choices` and in the disk cache's record for `pass`.
    /// Only if every candidate failed is it an error ([`Error::Tuning`]).
    pub(crate) fn keep_fastest<C: Candidate>(
        &self,
        (pass, choices): (Pass, &Choices<C>),
        spec: &Spec,
        class: ShapeClass,
        candidates: Vec<(C, Result<f64, Error>)>,
    ) -> Result<TuneReport<C>, Error> {
        let fastest = candidates
            .iter()
            .filter_map(|(config, ms)| Some((*config, *ms.as_ref().ok()?)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((best, _)) = fastest else {
            let failures = candidates.into_iter().filter_map(|(c, ms)| Some((c.name(), ms.err()?))).collect();
            return Err(Error::Tuning { spec: spec.name.clone(), failures });
        };

        choices.replace(spec, class, Choice { config: best, tuned: true });
        if let Some(disk) = &self.disk {
            let times: Vec<_> = candidates.iter().map(|(c, ms)| (*c, ms.as_ref().ok().copied())).collect();
            let key = TuningKey::new(pass, &to_source(spec), class, self.arch(), CODEGEN_VERSION);
            let record = Record { key, pass, spec, class, arch: self.arch(), times: &times, best };
            // Like the kernel cache, a failed store only costs a later tuning.
            if let Err(e) = disk.store_tuning(&record) {
                eprintln!("flashgen: warning: cannot store a tuning record in {}: {e}", disk.tuning_dir().display());
            }
        }
        Ok(TuneReport { spec: spec.name.clone(), class, best, candidates })
    }
}
