"""Every detector threshold, its default and its ``analyze`` / ``compare`` flag, in one place.

Plain dataclasses and argparse only (no numpy, no pandas): the command line builds its parser from
here without loading the detectors. Definitions of what each threshold does: docs/detectors.md.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from gradscope.ranges import COUNT, WHOLE, Range


@dataclass(frozen=True)
class AmplificationConfig:
    coherence: float = 0.75   # coherence threshold
    window: int = 10          # steps per window
    fraction: float = 0.8     # share of the window's steps above the threshold
    norm_ratio: float = 2.0   # "dominant": the role's norm ≥ this × the other roles' median (on `fraction`)
    rise_z: float = 2.0       # "rising": the window's log-norm slope ≥ this many standard errors above 0
    gap: int = 20             # episodes of one role at most this many steps apart are one finding
    update_ratio: float = 2.0  # update channel: the role's policy moves ≥ this × the other policies per step


@dataclass(frozen=True)
class CaptureConfig:
    share: float = 0.7        # contribution-share threshold
    window: int = 10
    fraction: float = 0.8
    excess: float = 0.1       # token / per-token share above the fair 1/R that "explains" dominance
    gap: int = 20             # episodes of one role and set at most this many steps apart are one finding


@dataclass(frozen=True)
class CliffConfig:
    min_drop: float = 0.10      # absolute drop below the running peak
    min_rel_drop: float = 0.15  # ... and relative to the peak
    within: int = 5             # evaluations from onset to the threshold
    smooth: int = 3             # running-median width (1 = none)


@dataclass(frozen=True)
class AnalysisConfig:
    amplification: AmplificationConfig = field(default_factory=AmplificationConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    cliff: CliffConfig = field(default_factory=CliffConfig)


#: Allowed values of the threshold flags (coherence AF/n lies in [0, 1]; a signed contribution share
#: can be any finite number); a bad one is argparse's one-line usage error.
UNIT, NONNEG, SHARE = Range(0, 1), Range(0), Range()


def add_threshold_arguments(p: argparse.ArgumentParser) -> None:
    """The threshold flags of ``analyze`` and ``compare``, defaulting to the dataclasses' values."""
    a, c, k = AmplificationConfig(), CaptureConfig(), CliffConfig()
    p.add_argument("--coherence", type=UNIT.arg, default=a.coherence, help="amplification: coherence threshold")
    p.add_argument("--norm-ratio", type=NONNEG.arg, default=a.norm_ratio,
                   help="amplification: 'dominant' when the role's norm is this many times the other roles' median")
    p.add_argument("--rise-z", type=NONNEG.arg, default=a.rise_z,
                   help="amplification: 'rising' when the log-norm's slope over the window is this many standard "
                        "errors above 0")
    p.add_argument("--update-ratio", type=NONNEG.arg, default=a.update_ratio,
                   help="amplification, update channel: a multi-agent role's policy moves this many times as far "
                        "(relative update per training step) as the other policies' median")
    p.add_argument("--share", type=SHARE.arg, default=c.share, help="capture: contribution-share threshold")
    p.add_argument("--window", type=COUNT.arg, default=a.window, help="steps per detection window")
    p.add_argument("--fraction", type=Range(0, 1, lo_open=True).arg, default=a.fraction,
                   help="share of a window above threshold")
    p.add_argument("--gap", type=WHOLE.arg, default=a.gap,
                   help="amplification and capture: episodes of one role at most this many step numbers apart merge")
    p.add_argument("--min-drop", type=NONNEG.arg, default=k.min_drop, help="cliff: absolute accuracy drop")
    p.add_argument("--min-rel-drop", type=UNIT.arg, default=k.min_rel_drop, help="cliff: relative drop")
    p.add_argument("--within", type=COUNT.arg, default=k.within, help="cliff: evaluations from onset to threshold")


def config_from(args: argparse.Namespace) -> AnalysisConfig:
    """The AnalysisConfig of parsed threshold flags."""
    return AnalysisConfig(
        amplification=AmplificationConfig(coherence=args.coherence, window=args.window, fraction=args.fraction,
                                          norm_ratio=args.norm_ratio, rise_z=args.rise_z, gap=args.gap,
                                          update_ratio=args.update_ratio),
        capture=CaptureConfig(share=args.share, window=args.window, fraction=args.fraction, gap=args.gap),
        cliff=CliffConfig(min_drop=args.min_drop, min_rel_drop=args.min_rel_drop, within=args.within))
