"""What goes into the syncer core (events) and what comes out of it (effects).

The core never touches a socket, a timer or a file: the shell (the daemon, the simulator, replay)
turns what it sees into events, calls `syncer.handle(state, event, now)` and carries out the effects
it gets back. Everything here is a small frozen value; payloads are parsed `Encoded` views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ddiloco.core.codec import Encoded
from ddiloco.core.layout import TensorSpec
from ddiloco.core.weights import token_weight

# ---- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Join:
    conn: int  # the shell's id for the connection, until the core has assigned a learner id
    name: str
    tensors: tuple[TensorSpec, ...]
    protocol: int
    peer_url: str = ""  # where the learner serves its state to (re)joining peers; "" if it does not


@dataclass(frozen=True)
class InitFragment:
    """Initial fp32 parameters of one fragment from the learner the syncer asked for them."""

    learner: int
    fragment: int
    payload: Encoded


@dataclass(frozen=True)
class Progress:
    learner: int
    step: int
    versions: tuple[int, ...]  # per fragment: the version it holds (-1: none yet)
    steps: tuple[int, ...]  # per fragment: inner steps since it received that version
    tokens: tuple[int, ...]  # per fragment: tokens since it received that version
    # per fragment: of `tokens`, those trained under the version before and carried over the merge
    # (the learner kept that progress: docs/algorithm.md "Progress carried over a merge"); () none
    carried: tuple[int, ...] = ()


@dataclass(frozen=True)
class Push:
    """A learner's outer gradient of one fragment: the one shape of a push from the learner to the merge.

    The learner pushes on its own schedule (protocol 2: at its step `step` with step mod H == t_p,
    docs/protocol.md, "Learner-driven pushes"); the syncer decides which round of the fragment it
    joins, and discounts it by its staleness at merge time (docs/algorithm.md). The learner makes it once (`learner.sync`, its payload the encoder's buffer); the wire message
    carries the same fields (net.session, the payload's body and its codec, block and size); on the
    syncer it is rebuilt over the received bytes, `learner` set from the connection (the sender's own
    `learner` is never trusted, nor sent), and the core keeps it in the open round as it is: it is
    also what the merge reads (core.merge.Contribution)."""

    learner: int
    fragment: int
    step: int  # the learner's step at which it computed the outer gradient
    base_version: int
    steps: int
    tokens: int
    payload: Encoded

    @property
    def weight(self) -> float:
        """The push's token weight (core.weights), not yet normalised; valid once admitted (counters checked)."""
        return token_weight(self.tokens, self.steps)


@dataclass(frozen=True)
class TimerFired:
    fragment: int
    round: int


@dataclass(frozen=True)
class Disconnect:
    learner: int
    reason: str


@dataclass(frozen=True)
class MergeCost:
    """How long the shell took to merge and hand out a fragment: the sync time of the grace formula."""

    seconds: float


Event = Union[Join, InitFragment, Progress, Push, TimerFired, Disconnect, MergeCost]

# ---- effects ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendWelcome:
    conn: int
    learner: int
    layout: dict  # Layout.describe() of the syncer's layout
    digest: str
    versions: tuple[int, ...]
    global_step: int
    needs_init: bool  # the syncer holds no parameters and asks this learner for them
    peers: tuple[tuple[int, str, tuple[int, ...]], ...] = ()  # (learner, peer url, versions) of live peers
    # The round schedule (core.schedule): fragment p's round opens at global steps t with
    # t mod period == offsets[p]; a learner pushes fragment p at its own steps t of that phase, and
    # reports its progress at those steps without delay.
    period: int = 1
    offsets: tuple[int, ...] = ()
    # A sharded syncer (core.shards): this syncer is shard `shard` of `shards` and owns only its
    # fragments; the learner reaches every shard and routes each fragment to its owner.
    shard: int = 0
    shards: int = 1


@dataclass(frozen=True)
class SendUpdate:
    """Send fragment `fragment` to some learners. The shell takes the values with
    `syncer.update_values` when it actually sends (between two `handle` calls), so a learner that
    is behind gets the newest version, encoded once however many learners wait for it.

    With `base_version` >= 0 the version goes out as the delta onto the published copy of
    `base_version` (its codec body in blocks of `block`, 0 for fp32 and bf16) to each learner whose
    connection was last sent that version, and whole (fp32) to the others; with -1, whole to all
    (docs/protocol.md, "Delta broadcast")."""

    learners: tuple[int, ...]
    fragment: int
    version: int  # the version at the time of the effect (a newer one may be sent)
    base_version: int = -1
    block: int = 0


@dataclass(frozen=True)
class SendError:
    code: str  # one of ERROR_CODES
    text: str
    fatal: bool = False
    learner: int | None = None
    conn: int | None = None  # for errors before a learner id exists


@dataclass(frozen=True)
class ArmTimer:
    fragment: int
    round: int
    at: float  # on the syncer's monotonic clock


@dataclass(frozen=True)
class Drop:
    """Close the learner's connection (after any error already emitted)."""

    learner: int | None
    conn: int | None
    reason: str


@dataclass(frozen=True)
class WriteCheckpoint:
    reason: str


@dataclass(frozen=True)
class Log:
    level: str  # "info" | "warning"
    text: str


@dataclass(frozen=True)
class Merged:
    """A fragment got a new version (for metrics and the status page)."""

    fragment: int
    version: int
    learners: tuple[int, ...]
    weights: tuple[float, ...]  # normalised token weights, in the order of `learners`
    grace_s: float
    round_s: float  # round open to close


Effect = Union[SendWelcome, SendUpdate, SendError, ArmTimer, Drop, WriteCheckpoint, Log, Merged]

ERROR_CODES = (
    "bad_layout",
    "bad_shape",
    "non_finite",
    "stale",
    "late",
    "duplicate",
    "unknown_round",
    "not_live",
    "bad_counters",
    "protocol_version",
    "overloaded",
    "unexpected",
    "wrong_shard",  # a push or initial fragment sent to a shard that does not own the fragment (core.shards)
)


@dataclass(frozen=True)
class Rejection:
    """Why a push was refused: the error code and the text the learner and the log see."""

    code: str
    text: str
    fate: str = field(default="rejected")
