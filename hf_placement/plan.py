"""`PlacementPlan`: which ranks hold which RLHF role. Pure data, validated, serialisable; no torch.distributed here.

Roles (FlexRLHF / APP, arXiv 2312.11819, §3):

- ``actor`` / ``critic``: the trained policy and value model (with optimizer state);
- ``ref`` / ``reward``: frozen reference policy and reward model;
- ``rollout``: the shadow actor that generates (disaggregated plans only; may have several replicas);
- ``value``: the shadow critic that computes old values (disaggregated plans only).

In co-located and interleaved plans generation and value inference run on the actor / critic themselves, so the
shadow roles are absent. The three strategies of the paper are constructors:

- `PlacementPlan.colocated(world)`: every role on every rank (TRL, DeepSpeed-Chat);
- `PlacementPlan.interleaved(world, ratios={"ref": 0.5, "reward": 0.5})`: APP's packing rule, ref on the first half of
  the ranks and reward on the second half, so the two run concurrently on disjoint owners;
- `PlacementPlan.disaggregated(world, train_ranks=..., infer_ranks=..., rollout_replicas=k)`: a training group
  (actor, critic) and an inference group (rollout, value, ref, reward) joined by a weight sync.

Validation rules (errors name the role and the fix): known role names; the four base roles present and non-empty;
ranks inside the world; no rank unused; role rank sets are pairwise identical, disjoint or nested (a partial overlap
would make two "concurrent" roles serialise on the shared ranks); shadow roles disjoint from the trainers; replicas
divide the rollout ranks. Batch divisibility is checked separately by `PlacementPlan.check_batch`, because the batch
is not part of the plan.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BASE_ROLES", "PlacementPlan", "ROLES", "SHADOW_ROLES", "STRATEGIES", "TRAINED_ROLES"]

BASE_ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward")
SHADOW_ROLES: tuple[str, ...] = ("rollout", "value")
ROLES: tuple[str, ...] = BASE_ROLES + SHADOW_ROLES
TRAINED_ROLES: tuple[str, ...] = ("actor", "critic")
STRATEGIES: tuple[str, ...] = ("colocated", "interleaved", "disaggregated", "custom")
#: which trained role each shadow role mirrors (the weight-sync source).
SHADOW_OF: dict[str, str] = {"rollout": "actor", "value": "critic"}

_PLAN_KEYS = ("world_size", "roles", "strategy", "rollout_replicas", "sharded_roles")


def _fmt(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


@dataclass
class PlacementPlan:
    """Roles mapped to rank lists for one job of ``world_size`` ranks.

    Args:
        world_size (`int`): number of ranks of the job; must match ``torch.distributed``'s world at run time.
        roles (`dict[str, list[int]]`): role name -> ranks that hold (own) the role's model. Keys among
            ``actor, critic, ref, reward, rollout, value``.
        strategy (`str`, *optional*, defaults to `"custom"`): label only (``colocated``, ``interleaved``,
            ``disaggregated`` or ``custom``); validation is the same for all.
        rollout_replicas (`int`, *optional*, defaults to 1): number of shadow-actor replicas; the rollout ranks are
            cut into this many groups of consecutive ranks, each holding one full copy of the generation weights.
        sharded_roles (`list[str]` or `dict[str, str]`, *optional*): roles whose model is sharded inside the
            role's rank group instead of replicated, each with the PaRO strategy of the engine that shards it
            (three letters for the partition level of parameters, gradients and optimizer states; a list means
            ``"GGG"``, ZeRO-3, for every role). The plan stores the strategy; the engine that runs it validates it.

    Example:

    ```python
    >>> from hf_placement import PlacementPlan
    >>> plan = PlacementPlan.interleaved(4)
    >>> plan.roles["ref"], plan.roles["reward"]
    ([0, 1], [2, 3])
    >>> plan.owner_of("ref", 3)  # rank 3 sends its ref inputs to rank 1 and gets the log-probs back
    1
    ```
    """

    world_size: int = field(metadata={"help": "Number of ranks of the job."})
    roles: dict[str, list[int]] = field(metadata={"help": "Role name -> ranks that own the role's model."})
    strategy: str = field(default="custom", metadata={"help": f"Label among {STRATEGIES}."})
    rollout_replicas: int = field(default=1, metadata={"help": "Shadow-actor replicas (disaggregated plans)."})
    sharded_roles: dict[str, str] = field(default_factory=dict, metadata={
        "help": "Role -> PaRO strategy of the engine that shards it inside its rank group (a list means 'GGG')."})

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}. Pass the number of "
                             "ranks of the job (WORLD_SIZE).")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}. Use 'custom' for a hand-made "
                             "plan.")
        if not isinstance(self.roles, Mapping):
            raise TypeError(f"roles must be a mapping role -> list of ranks, got {type(self.roles).__name__}.")
        self.roles = {str(k): self._normalise_ranks(str(k), v) for k, v in self.roles.items()}
        self.sharded_roles = _normalise_sharded(self.sharded_roles)
        self.validate()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def colocated(cls, world_size: int, sharded: bool | str = False) -> PlacementPlan:
        """Every role on every rank (TRL / DeepSpeed-Chat). ``sharded=True`` shards all four models over the world
        (ZeRO-3, ``"GGG"``); a strategy string such as ``"IIG"`` shards them with that PaRO strategy."""
        everyone = list(range(world_size)) if isinstance(world_size, int) and world_size > 0 else []
        strategy = sharded if isinstance(sharded, str) else DEFAULT_SHARD_STRATEGY
        return cls(world_size=world_size, roles={r: list(everyone) for r in BASE_ROLES}, strategy="colocated",
                   sharded_roles=dict.fromkeys(BASE_ROLES, strategy) if sharded else {})

    @classmethod
    def interleaved(cls, world_size: int, ratios: Mapping[str, float] | None = None,
                    sharded_roles: Sequence[str] | Mapping[str, str] = ()) -> PlacementPlan:
        """APP's packing rule: roles get ``ratio * world_size`` consecutive ranks, filled in role order into "layers"
        of the whole world; a role never crosses a layer boundary. Default ratios: actor 1, critic 1, ref 0.5,
        reward 0.5 (ref on the first half, reward on the second half).
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
        merged = {"actor": 1.0, "critic": 1.0, "ref": 0.5, "reward": 0.5}
        if ratios:
            unknown = sorted(set(ratios) - set(BASE_ROLES))
            if unknown:
                raise ValueError(f"placement ratios name unknown role(s) {unknown}; ratios apply to {BASE_ROLES}.")
            merged.update({k: float(v) for k, v in ratios.items()})
        roles: dict[str, list[int]] = {}
        cursor = 0
        for role in BASE_ROLES:
            ratio = merged[role]
            if not 0 < ratio <= 1:
                raise ValueError(f"placement ratio for role '{role}' is {ratio}; it must be in (0, 1] (a fraction of "
                                 "the world). Use 1 for 'all ranks'.")
            count = ratio * world_size
            if abs(count - round(count)) > 1e-9 or round(count) < 1:
                raise ValueError(f"placement ratio {ratio} for role '{role}' gives {count:g} of {world_size} ranks; "
                                 f"ratios must give a whole number of ranks (multiples of 1/{world_size}).")
            count = int(round(count))
            if cursor + count > world_size:
                if cursor != world_size:
                    raise ValueError(
                        f"placement ratios do not pack: role '{role}' needs {count} ranks but only "
                        f"{world_size - cursor} remain in the current layer (ranks {cursor}..{world_size - 1}). "
                        "Make the ratios of roles that share a layer add up to 1 (e.g. ref 0.5 + reward 0.5)."
                    )
                cursor = 0
            roles[role] = list(range(cursor, cursor + count))
            cursor = cursor + count
            if cursor == world_size:
                cursor = 0
        return cls(world_size=world_size, roles=roles, strategy="interleaved", sharded_roles=sharded_roles)

    @classmethod
    def disaggregated(cls, world_size: int, train_ranks: Sequence[int] | None = None,
                      infer_ranks: Sequence[int] | None = None, rollout_replicas: int = 1,
                      sharded_roles: Sequence[str] | Mapping[str, str] = ()) -> PlacementPlan:
        """Training group (actor, critic) and inference group (rollout, value, ref, reward) on disjoint ranks.

        Defaults: the first half of the ranks train, the second half infer (for an odd world the extra rank infers,
        since generation is usually the bottleneck).
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
            raise ValueError(f"a disaggregated plan needs world_size >= 2 (one training and one inference rank), got "
                             f"{world_size!r}. Use PlacementPlan.colocated for a single rank.")
        if train_ranks is None and infer_ranks is None:
            train_ranks = list(range(world_size // 2))
        if train_ranks is None:
            train_ranks = [r for r in range(world_size) if r not in set(infer_ranks)]
        if infer_ranks is None:
            infer_ranks = [r for r in range(world_size) if r not in set(train_ranks)]
        train, infer = list(train_ranks), list(infer_ranks)
        both = sorted(set(train) & set(infer))
        if both:
            raise ValueError(f"train_ranks {_fmt(train)} and infer_ranks {_fmt(infer)} share rank(s) {both}; a "
                             "disaggregated plan needs disjoint groups. Use interleaved/colocated to share ranks.")
        roles = {"actor": train, "critic": list(train), "ref": infer, "reward": list(infer),
                 "rollout": list(infer), "value": list(infer)}
        return cls(world_size=world_size, roles=roles, strategy="disaggregated", rollout_replicas=rollout_replicas,
                   sharded_roles=sharded_roles)

    @classmethod
    def custom(cls, world_size: int, roles: Mapping[str, Sequence[int]], rollout_replicas: int = 1,
               sharded_roles: Sequence[str] | Mapping[str, str] = ()) -> PlacementPlan:
        """Any validated role -> ranks mapping."""
        return cls(world_size=world_size, roles={k: list(v) for k, v in roles.items()}, strategy="custom",
                   rollout_replicas=rollout_replicas, sharded_roles=sharded_roles)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _normalise_ranks(role: str, ranks: Any) -> list[int]:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"role '{role}' must map to a list of ranks, got {ranks!r}.")
        out = []
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"role '{role}' has a non-integer rank {r!r}; ranks are integers 0..world_size-1.")
            out.append(int(r))
        return out

    def validate(self) -> None:
        """Check the plan against itself; raise `ValueError` naming the role and the fix."""
        unknown = sorted(set(self.roles) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown role(s) {unknown}; valid roles are {ROLES}.")
        for role in BASE_ROLES:
            if role not in self.roles:
                raise ValueError(f"role '{role}' is missing; every plan places {BASE_ROLES}. Give '{role}' a list of "
                                 "ranks.")
        for role, ranks in self.roles.items():
            if not ranks:
                raise ValueError(f"role '{role}' has no ranks; every role needs at least one rank. Give '{role}' "
                                 f"ranks in 0..{self.world_size - 1} or remove it (shadow roles only).")
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"role '{role}' has rank(s) {bad} outside the world of {self.world_size} ranks "
                                 f"(valid: 0..{self.world_size - 1}). Fix the ranks or the world_size.")
            if len(set(ranks)) != len(ranks):
                dup = sorted({r for r in ranks if ranks.count(r) > 1})
                raise ValueError(f"role '{role}' lists rank(s) {dup} more than once; list each rank once.")
        shadows = [r for r in SHADOW_ROLES if r in self.roles]
        if len(shadows) == 1:
            missing = "value" if shadows[0] == "rollout" else "rollout"
            raise ValueError(f"role '{shadows[0]}' is placed but '{missing}' is not; a disaggregated plan needs both "
                             f"shadow roles (rollout = shadow actor, value = shadow critic). Add '{missing}'.")
        for shadow in shadows:
            for trained in TRAINED_ROLES:
                shared = sorted(set(self.roles[shadow]) & set(self.roles[trained]))
                if shared:
                    raise ValueError(
                        f"role '{shadow}' (shadow model) shares rank(s) {shared} with '{trained}'; shadow models live "
                        "on inference ranks only. Move them to ranks without actor/critic, or drop the shadow roles "
                        "and use a colocated/interleaved plan (generation then runs on the actor itself)."
                    )
        names = [r for r in ROLES if r in self.roles]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                sa, sb = set(self.roles[a]), set(self.roles[b])
                if sa & sb and not (sa <= sb or sb <= sa):
                    raise ValueError(
                        f"roles '{a}' {_fmt(sorted(sa))} and '{b}' {_fmt(sorted(sb))} partially overlap on "
                        f"{sorted(sa & sb)}: role groups must be identical, disjoint or nested, otherwise the shared "
                        "ranks serialise the two roles and collectives of concurrent roles can deadlock. Make them "
                        "disjoint (e.g. ref on the first half, reward on the second) or identical."
                    )
        used = set().union(*(set(v) for v in self.roles.values()))
        idle = sorted(set(range(self.world_size)) - used)
        if idle:
            raise ValueError(f"rank(s) {idle} hold no role: world_size={self.world_size} does not match the plan "
                             f"(ranks used: {sorted(used)}). Give those ranks a role or lower world_size.")
        if isinstance(self.rollout_replicas, bool) or not isinstance(self.rollout_replicas, int) \
                or self.rollout_replicas < 1:
            raise ValueError(f"rollout_replicas must be a positive integer, got {self.rollout_replicas!r}.")
        if self.rollout_replicas > 1:
            if "rollout" not in self.roles:
                raise ValueError(f"rollout_replicas={self.rollout_replicas} needs a 'rollout' role (disaggregated "
                                 "plan); colocated/interleaved plans generate with the actor. Set it to 1.")
            n = len(self.roles["rollout"])
            if n % self.rollout_replicas:
                raise ValueError(f"rollout_replicas={self.rollout_replicas} does not divide the {n} rollout ranks "
                                 f"{_fmt(self.roles['rollout'])}; choose a divisor of {n}.")
        bad_sharded = [r for r in self.sharded_roles if r not in self.roles]
        if bad_sharded:
            raise ValueError(f"sharded_roles names role(s) {bad_sharded} that the plan does not place "
                             f"(placed: {names}).")

    def check_world_size(self, world_size: int) -> None:
        """Raise if the job's world size differs from the plan's (validation against the runtime)."""
        if world_size != self.world_size:
            ctor = self.strategy if self.strategy != "custom" else "colocated"
            raise ValueError(f"the plan is for world_size={self.world_size} but the job has {world_size} ranks. "
                             f"Rebuild the plan for {world_size} ranks (e.g. PlacementPlan.{ctor}({world_size})) "
                             "or launch with the plan's world size.")

    def check_batch(self, global_batch_size: int, micro_batch_size: int | None = None) -> None:
        """Raise if a global batch does not split evenly over the data-parallel shares of every role.

        Each role's ranks split the batch (actor/critic train on equal shares; owners of ref/reward/value serve equal
        shares; the rollout batch splits over replicas and then over the ranks of a replica). ``micro_batch_size``
        must then divide every per-rank share.
        """
        if global_batch_size < 1:
            raise ValueError(f"global batch size must be >= 1, got {global_batch_size}.")
        for role, ranks in self.roles.items():
            shares = len(ranks)
            if global_batch_size % shares:
                raise ValueError(
                    f"batch size {global_batch_size} does not divide among the {shares} owner ranks of role "
                    f"'{role}' {_fmt(ranks)}; use a batch size that is a multiple of {shares} "
                    f"(e.g. {shares * max(1, round(global_batch_size / shares))})."
                )
            if micro_batch_size is not None:
                share = global_batch_size // shares
                if micro_batch_size < 1 or share % micro_batch_size:
                    raise ValueError(f"micro batch size {micro_batch_size} does not divide the per-rank share "
                                     f"{share} of role '{role}' ({global_batch_size} / {shares} ranks); choose a "
                                     f"divisor of {share}.")

    # ------------------------------------------------------------------ queries
    @property
    def is_disaggregated(self) -> bool:
        return "rollout" in self.roles

    def ranks(self, role: str) -> list[int]:
        if role not in self.roles:
            raise KeyError(f"role '{role}' is not placed by this {self.strategy} plan (placed: {list(self.roles)}).")
        return list(self.roles[role])

    def roles_of(self, rank: int) -> list[str]:
        """Roles whose model lives on ``rank``."""
        return [r for r in ROLES if r in self.roles and rank in self.roles[r]]

    def generation_role(self) -> str:
        """The role that generates: the shadow actor when present, else the actor."""
        return "rollout" if self.is_disaggregated else "actor"

    def data_ranks(self) -> list[int]:
        """Ranks that hold micro-batches of experience to dispatch (the generators)."""
        return self.ranks(self.generation_role())

    def rank_sets(self) -> list[tuple[int, ...]]:
        """Distinct role rank sets in deterministic order (role order, first occurrence)."""
        out: list[tuple[int, ...]] = []
        for role in ROLES:
            if role in self.roles:
                key = tuple(sorted(self.roles[role]))
                if key not in out:
                    out.append(key)
        return out

    def role_group_size(self, role: str, ranks_per_node: int | None = None) -> int:
        """Ranks per intra group inside ``role``'s rank set: ``ranks_per_node`` clipped to the role's size.

        This is the ``m`` of a two-level layout over the role's ranks (consecutive members form a group), the group
        an I-level partition of a sharded role uses. ``None``: the whole role is one group.
        """
        n = len(self.ranks(role))
        m = n if not ranks_per_node else min(int(ranks_per_node), n)
        if m < 1 or n % m:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(f"role '{role}' has {n} ranks {_fmt(self.ranks(role))}, which do not split into groups "
                             f"of {m} ranks per node; sharding it needs equal groups. Place it on a multiple of the "
                             f"ranks per node, or run with ranks per node among {divisors}.")
        return m

    def replica_ranks(self) -> list[list[int]]:
        """Rollout ranks cut into ``rollout_replicas`` groups of consecutive (sorted) ranks."""
        ranks = sorted(self.ranks("rollout"))
        k = len(ranks) // self.rollout_replicas
        return [ranks[i * k:(i + 1) * k] for i in range(self.rollout_replicas)]

    def partners(self, role: str, data_ranks: Sequence[int] | None = None) -> dict[int, list[int]]:
        """Owner -> data ranks it serves besides itself (APP's GroupPlacePolicy).

        Non-owner data ranks are assigned to owners round-robin in rank order, so every owner serves at most
        ``ceil(non_owners / owners)`` partners.
        """
        owners = sorted(self.ranks(role))
        data = sorted(self.data_ranks() if data_ranks is None else data_ranks)
        others = [r for r in data if r not in owners]
        out: dict[int, list[int]] = {o: [] for o in owners}
        for i, r in enumerate(others):
            out[owners[i % len(owners)]].append(r)
        return out

    def owner_of(self, role: str, rank: int, data_ranks: Sequence[int] | None = None) -> int:
        """The owner rank that runs ``role`` for ``rank``'s micro-batch (``rank`` itself when it is an owner)."""
        if rank in self.roles.get(role, []):
            return rank
        for owner, partners in self.partners(role, data_ranks).items():
            if rank in partners:
                return owner
        raise ValueError(f"rank {rank} is neither an owner of '{role}' nor a data rank it serves.")

    def experience_routes(self) -> dict[int, list[int]]:
        """Disaggregated plans: rollout rank -> actor ranks that train on its experience.

        Generators and trainers are paired round-robin over ``max(#rollout, #actor)`` slots, so every trainer is fed
        and every generator feeds at least one trainer; a generator with several trainers splits its micro-batches
        among them in the listed order.
        """
        if not self.is_disaggregated:
            raise ValueError(f"experience routes exist only in disaggregated plans; this {self.strategy} plan trains "
                             "on the ranks that generate.")
        gens, trainers = sorted(self.roles["rollout"]), sorted(self.roles["actor"])
        out: dict[int, list[int]] = {g: [] for g in gens}
        for k in range(max(len(gens), len(trainers))):
            t = trainers[k % len(trainers)]
            if t not in out[gens[k % len(gens)]]:
                out[gens[k % len(gens)]].append(t)
        return out

    def sync_pairs(self) -> list[tuple[str, str]]:
        """(trained role, shadow role) pairs that need a weight sync every iteration."""
        return [(src, dst) for dst, src in SHADOW_OF.items() if dst in self.roles]

    def describe(self) -> str:
        """A small human-readable table: one line per role."""
        lines = [f"{self.strategy} plan, world_size={self.world_size}"
                 + (f", rollout_replicas={self.rollout_replicas}" if self.is_disaggregated else "")]
        for role in ROLES:
            if role in self.roles:
                tag = f" (sharded, {self.sharded_roles[role]})" if role in self.sharded_roles else ""
                lines.append(f"  {role:<8} {_fmt(self.roles[role])}{tag}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "strategy": self.strategy,
                "roles": {r: list(self.roles[r]) for r in ROLES if r in self.roles},
                "rollout_replicas": self.rollout_replicas, "sharded_roles": dict(self.sharded_roles)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlacementPlan:
        if not isinstance(data, Mapping):
            raise TypeError(f"a plan must be a mapping with keys {_PLAN_KEYS}, got {type(data).__name__}.")
        unknown = sorted(set(data) - set(_PLAN_KEYS))
        if unknown:
            raise ValueError(f"unknown plan key(s) {unknown}; valid keys are {list(_PLAN_KEYS)}.")
        for key in ("world_size", "roles"):
            if key not in data:
                raise ValueError(f"plan is missing required key '{key}' (required: world_size, roles).")
        return cls(**{k: data[k] for k in _PLAN_KEYS if k in data})

    def save(self, path: str | Path) -> Path:
        """Write the plan as YAML (``.yaml``/``.yml``) or JSON (any other suffix)."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> PlacementPlan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"placement plan file {str(path)!r} does not exist.")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data)


def _role_order(role: str) -> int:
    return ROLES.index(role) if role in ROLES else len(ROLES)


#: Strategy of a sharded role given without one (a list of roles): everything partitioned over the role's ranks.
DEFAULT_SHARD_STRATEGY = "GGG"


def _normalise_sharded(sharded: Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    """``["actor", "ref"]`` or ``{"actor": "iig"}`` -> ``{role: "STRATEGY"}`` in role order."""
    if sharded is None:
        return {}
    if isinstance(sharded, str):
        raise TypeError(f"sharded_roles={sharded!r} must be a list of roles or a mapping role -> strategy, not a "
                        "string; e.g. ['actor', 'critic'] or {'actor': 'IIG'}.")
    items = sharded.items() if isinstance(sharded, Mapping) else ((r, DEFAULT_SHARD_STRATEGY) for r in sharded)
    out: dict[str, str] = {}
    for role, strategy in items:
        if not isinstance(strategy, str) or not strategy.strip():
            raise TypeError(f"sharded_roles['{role}'] = {strategy!r}: the strategy is a string such as 'GGG' "
                            "(ZeRO-3) or 'IIG'.")
        out[str(role)] = strategy.strip().upper()
    return dict(sorted(out.items(), key=lambda kv: _role_order(kv[0])))
