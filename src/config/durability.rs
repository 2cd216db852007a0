//! `--require-durability`'s levels, as the command line names them.
//!
//! May import: `domain`.

/// `--require-durability`: see [`super::Config::require_durability`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DurabilityLevel {
    Fleet,
    Replicated,
    Synced,
}

impl DurabilityLevel {
    pub(crate) fn requirement(self) -> crate::domain::durability::Requirement {
        use crate::domain::durability::Requirement;
        match self {
            Self::Fleet => Requirement::Fleet,
            Self::Replicated => Requirement::Replicated,
            Self::Synced => Requirement::Synced,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Fleet => "fleet",
            Self::Replicated => "replicated",
            Self::Synced => "synced",
        }
    }
}
