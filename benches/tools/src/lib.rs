//! `xdev-tools`: the command-line tools of the workspace, in a package of
//! their own so that no library carries command-line code. It holds the
//! binaries `xdev-run` (the launcher of xdev jobs), `xdev-rank` (one rank of
//! a test job on any multi-process device) and `ibvx-pingpong` (verbs
//! latency and bandwidth, perftest-compatible; feature `pingpong`), the
//! engine of `ibvx-pingpong` ([`pingpong`]), and what the binaries share:
//! [`init_tracing`], the subscriber that prints the libraries' `tracing`
//! events.
//!
//! It is not a library for others (`publish = false`); the parsers of its
//! binaries are `lexopt`'s.

#[cfg(feature = "pingpong")]
pub mod pingpong;

/// The environment variable that filters the events the tools print
/// (`tracing-subscriber`'s `EnvFilter` syntax, e.g. `xdev=debug,warn`).
pub const LOG_ENV: &str = "XDEV_LOG";

/// Installs the subscriber of a tool: the libraries' `tracing` events at
/// `warn` and above (or as [`LOG_ENV`] says) go to standard error, one line
/// each, prefixed with the tool's name. Does nothing if a subscriber is
/// already set.
pub fn init_tracing(tool: &'static str) {
    use tracing_subscriber::fmt::format::FmtSpan;
    use tracing_subscriber::EnvFilter;

    let filter = EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_span_events(FmtSpan::NONE)
        .with_target(true)
        .without_time()
        .with_ansi(false)
        .fmt_fields(tracing_subscriber::fmt::format::DefaultFields::new())
        .event_format(Prefixed(tool))
        .try_init();
}

/// One line per event: `TOOL: LEVEL TARGET: message key=value...`.
struct Prefixed(&'static str);

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Prefixed
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        write!(
            writer,
            "{}: {} {}: ",
            self.0,
            meta.level().as_str().to_ascii_lowercase(),
            meta.target()
        )?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
