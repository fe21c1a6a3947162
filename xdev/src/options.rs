//! Typed, validated device options: each device declares the keys it knows
//! (an [`OptionSpec`] each, with the form of its value and a one-line doc),
//! and reads [`Config::options`] only through an [`Options`] built against
//! that list. Opening a device with a key it does not declare fails with
//! [`Error::UnknownOption`], which names the keys it knows; a value that does
//! not parse fails with [`Error::BadOption`], which names the key and the
//! expected form. Nothing is silently ignored.

use std::str::FromStr;

use crate::{Config, Error, Result};

/// One option a device knows.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct OptionSpec {
    /// The key. A key ending in `.` declares a prefix: every key that starts
    /// with it is accepted here and checked by whoever reads it (the hybrid
    /// device hands `local.*` and `remote.*` to the devices it opens).
    pub key: &'static str,
    /// The form of the value, as an error message says it ("a byte count",
    /// "auto, on or off").
    pub form: &'static str,
    /// One line: what the option does and its default.
    pub doc: &'static str,
}

impl OptionSpec {
    /// An option `key` whose value has the form `form`.
    pub const fn new(key: &'static str, form: &'static str, doc: &'static str) -> Self {
        OptionSpec { key, form, doc }
    }

    /// Whether this option takes `key` (equal to it, or under its prefix).
    pub fn accepts(&self, key: &str) -> bool {
        match self.key.strip_suffix('.') {
            Some(prefix) => key.strip_prefix(prefix).is_some_and(|k| k.starts_with('.')),
            None => self.key == key,
        }
    }
}

/// The options of one device, checked against the keys it declares.
#[derive(Clone, Copy, Debug)]
pub struct Options<'c> {
    device: &'static str,
    specs: &'static [OptionSpec],
    config: &'c Config,
}

impl<'c> Options<'c> {
    /// Checks every key of `config.options` against `specs`: the first key
    /// none of them accepts is [`Error::UnknownOption`].
    pub fn new(
        device: &'static str,
        specs: &'static [OptionSpec],
        config: &'c Config,
    ) -> Result<Self> {
        if let Some(key) = config
            .options
            .keys()
            .find(|k| !specs.iter().any(|s| s.accepts(k)))
        {
            return Err(Error::UnknownOption(Box::new(crate::UnknownOption {
                device,
                key: key.clone(),
                known: specs.iter().map(|s| s.key).collect(),
            })));
        }
        Ok(Options {
            device,
            specs,
            config,
        })
    }

    /// The device these options belong to.
    pub fn device(&self) -> &'static str {
        self.device
    }

    /// The value of `key` parsed as `T`, `None` when it is not set;
    /// [`Error::BadOption`] when it does not parse.
    ///
    /// # Panics
    ///
    /// If `key` is not one the device declared: that is a bug of the device,
    /// caught by its first test.
    pub fn get_opt<T: FromStr>(&self, key: &str) -> Result<Option<T>> {
        let spec = self.spec(key);
        match self.config.options.get(key) {
            None => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|_| {
                Error::BadOption(Box::new(crate::BadOption {
                    device: self.device,
                    key: key.to_string(),
                    value: v.clone(),
                    expected: spec.form,
                }))
            }),
        }
    }

    /// The value of `key` parsed as `T`, or `default` when it is not set.
    pub fn get<T: FromStr>(&self, key: &str, default: T) -> Result<T> {
        Ok(self.get_opt(key)?.unwrap_or(default))
    }

    /// The options under a declared prefix (`"local."`), with the prefix
    /// taken off, in key order.
    pub fn prefixed(&self, prefix: &str) -> Vec<(String, String)> {
        let spec = self.spec(prefix);
        debug_assert!(spec.key.ends_with('.'), "{prefix:?} is not a prefix option");
        self.config
            .options
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v.clone())))
            .collect()
    }

    fn spec(&self, key: &str) -> &'static OptionSpec {
        self.specs.iter().find(|s| s.key == key).unwrap_or_else(|| {
            panic!(
                "device {} reads option {key:?} it does not declare",
                self.device
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[OptionSpec] = &[
        OptionSpec::new("ring_bytes", "a byte count", "bytes per ring"),
        OptionSpec::new("local.", "options of the local device", "passed on"),
    ];

    #[test]
    fn unknown_key_names_the_known_ones() {
        let c = Config::new(0, 1, "j").with("ring_byte", 4096);
        let e = Options::new("dev", SPECS, &c).unwrap_err();
        match &e {
            Error::UnknownOption(u) => {
                assert_eq!((u.device, u.key.as_str()), ("dev", "ring_byte"));
                assert_eq!(u.known, &["ring_bytes", "local."]);
            }
            other => panic!("wrong error {other:?}"),
        }
        assert!(e.to_string().contains("ring_bytes, local."), "{e}");
    }

    #[test]
    fn bad_value_names_key_and_form() {
        let c = Config::new(0, 1, "j").with("ring_bytes", "4k");
        let o = Options::new("dev", SPECS, &c).unwrap();
        let e = o.get("ring_bytes", 0usize).unwrap_err();
        assert!(
            matches!(&e, Error::BadOption(b)
                if b.key == "ring_bytes" && b.value == "4k" && b.expected == "a byte count"),
            "{e:?}"
        );
    }

    #[test]
    fn values_defaults_and_prefixes() {
        let c = Config::new(0, 1, "j")
            .with("ring_bytes", 8192)
            .with("local.eager_limit", 64)
            .with("local.x", "y");
        let o = Options::new("dev", SPECS, &c).unwrap();
        assert_eq!(o.get("ring_bytes", 0usize).unwrap(), 8192);
        assert_eq!(o.get_opt::<usize>("ring_bytes").unwrap(), Some(8192));
        let none = Config::new(0, 1, "j");
        let o2 = Options::new("dev", SPECS, &none).unwrap();
        assert_eq!(o2.get("ring_bytes", 7usize).unwrap(), 7);
        assert_eq!(
            o.prefixed("local."),
            [
                ("eager_limit".to_string(), "64".to_string()),
                ("x".to_string(), "y".to_string())
            ]
        );
        // A prefix key alone ("local") is not under the prefix.
        let bare = Config::new(0, 1, "j").with("local", 1);
        assert!(Options::new("dev", SPECS, &bare).is_err());
    }
}
