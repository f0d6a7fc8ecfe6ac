//! The checked, asynchronous forward launch, in the tile configuration the
//! caller names, autotuning chose, or the preferred one.

use crate::args::ArgValue;
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::{ForwardIo, ForwardLaunch, ForwardOptions};
use crate::runtime::Runtime;
use flashgen_codegen::Spec;
use std::borrow::Cow;
use std::sync::Arc;

impl Runtime {
    /// Checks every size, stride, buffer length and argument against `spec`,
    /// then queues the kernel on [`Runtime::stream`] without waiting for it.
    /// A launch with no batch or no queries returns at once.
    ///
    /// With autotuning on forward launches ([`Runtime::with_autotune`],
    /// `FLASHGEN_AUTOTUNE=1`), a launch whose shape class has no choice yet
    /// first runs [`Runtime::autotune`] on these buffers, which waits for the GPU.
    ///
    /// Where the mask's global columns are `k < C` for a param C beside a
    /// band (sinks beside a window) and this launch's C fits a column tile
    /// (64 keys), the kernel is that of the spec with C bounded
    /// (`ColumnsParam`), compiled and tuned as a spec of its own (with a
    /// configuration given, where it is one of that spec's candidates too).
    pub fn forward<T: Element>(
        &self,
        spec: &Spec,
        io: ForwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let bounded = self.bounded_spec(spec, args, opts);
        let Some(mut launch) = ForwardLaunch::check(spec, bounded.as_deref(), io, args, opts)? else {
            return Ok(());
        };
        let config = match opts.config {
            Some(config) => self.candidate(launch.spec, config)?,
            None => self.config_for(&mut launch, opts)?,
        };
        launch.run(self, config, opts)
    }

    /// The spec whose forward kernel a launch of `spec` with `args` (its
    /// params first; the tensors may be left out) compiles and tunes:
    /// `spec`, or where the launch bounds the mask's global columns, that
    /// form (see [`Runtime::forward`]). Tuning choices and
    /// [`Runtime::tuned_config`] are that spec's.
    pub fn forward_spec<'s>(&self, spec: &'s Spec, args: &[ArgValue<'_>]) -> Cow<'s, Spec> {
        match self.bounded_spec(spec, args, &ForwardOptions::default()) {
            Some(bounded) => Cow::Owned((*bounded).clone()),
            None => Cow::Borrowed(spec),
        }
    }

    /// The bounded form of `spec` a forward launch with `args` and `opts`
    /// runs, if any (`crate::bounded_columns`). A configuration given is
    /// the spec's: bounded where it is the bounded spec's too (its column
    /// tile may take more shared memory). Dropout's kernels have no column
    /// tile.
    pub(crate) fn bounded_spec(
        &self,
        spec: &Spec,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Option<Arc<Spec>> {
        self.bounded.of(spec, args, self.target()).filter(|bounded| {
            let given = opts.config.is_none_or(|config| self.candidate(bounded, config).is_ok());
            given && opts.dropout.is_none_or(|dropout| dropout.p == 0.0)
        })
    }
}
