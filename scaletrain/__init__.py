"""scaletrain: training at scale, every technique written from scratch and checked
against single-device training."""

__version__ = "0.1.0"
