"""`LightTEAConfig`: every hyper-parameter of the LightTEA reference code, with its defaults except two widths.

The label width ``dim`` (reference: 512) and the triple view's projection width ``mini_dim`` (reference: 16) default
to half the reference's, and the candidates are searched in a 256-wide principal subspace (the reference searches the
full feature width): the products that dominate a run on CPUs without bf16 units then cost a half to a quarter, at
a small loss of accuracy (measured in ``bench/tea/README.md``). ``LightTEAConfig(dim=512, mini_dim=16,
candidate_dim=None)`` gives the reference's widths.

Paper: "An Effective and Efficient Time-aware Entity Alignment Framework via Two-aspect Three-view Label
Propagation" (Cai et al., IJCAI 2023, arXiv 2307.06013); reference code ``lcai2/LightTEA``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FUSIONS = ("sum", "concat")
FEATURELESS_ROWS = ("exclude", "include")
TIE_BREAKS = ("random", "first")

MATMUL_PRECISIONS = ("auto", "bfloat16", "float32", "int8")  # LightTEAConfig.matmul_precision; see precision.py
CANDIDATE_SEARCHES = ("auto", "exact", "faiss")  # LightTEAConfig.candidate_search; see ann.py
FEATURE_DTYPES = ("auto", "float16", "float32")  # LightTEAConfig.feature_dtype


@dataclass
class LightTEAConfig:
    """Hyper-parameters of LightTEA.

    > Parameters that control label propagation

    Parameters:
        dim (`int`, *optional*, defaults to `256`):
            Width d of the random seed labels (one unit Gaussian vector per seed pair and aspect). The reference uses
            512. The propagation's products grow with d and the triple view's with d times D_x (``aspect_dim``,
            d // 3 by default), so 256 halves the first and quarters the second; the accuracy at both widths is
            measured in ``bench/tea/README.md``.
        lp_steps (`int`, *optional*, defaults to `2`):
            Label-propagation steps. The reference hard-codes 2 (its ``--depth`` flag is ignored).
        aspect_dim (`int`, *optional*):
            D_x, the width of the relation/time embeddings of the triple view. ``None`` means the reference rule,
            ``dim // 2`` for ICEWS-like data (many time stamps, no unknown time) and ``dim // 3`` otherwise.
        mini_dim (`int`, *optional*, defaults to `8`):
            Width of each of the D_x random projections of the triple view; the output width is ``mini_dim * D_x``.
            The reference uses 16; 8 halves the triple view's products and the features (on YAGO-WIKI20K the
            change is within the spread between random seeds, ``bench/tea/README.md``).
        alpha (`float`, *optional*, defaults to `0.6`):
            Weight of the temporal aspect: ``F = (1 - alpha) F_rel + alpha F_time``.
        fusion (`str`, *optional*, defaults to `"sum"`):
            ``"sum"`` (reference) or ``"concat"`` (``[(1 - alpha) F_rel, alpha F_time]``, no cross-aspect noise).

    > Parameters that control similarity, Sinkhorn and evaluation

    Parameters:
        top_k (`int`, *optional*, defaults to `500`):
            Candidates kept per source entity (exact top-k of the structural similarity).
        beta (`float`, *optional*, defaults to `0.4`):
            Weight of the temporal (multiset-Dice) similarity, applied to the top-k candidates only.
        sinkhorn_temperature (`float`, *optional*, defaults to `0.02`):
            Scores enter Sinkhorn as ``exp(sim / temperature)``.
        sinkhorn_iterations (`int`, *optional*, defaults to `15`):
            Row-then-column normalisation rounds on the sparse candidate layout.
        tie_break (`str`, *optional*, defaults to `"random"`):
            How equal scores are ranked in evaluation. ``"random"`` (seeded) avoids leaking the answer on id-sorted
            pair files; ``"first"`` ranks the earlier candidate first, like the reference.
        block_rows (`int`, *optional*, defaults to `2048`):
            Rows per block of the similarity search. A block's scores are computed in column tiles of at most
            256 MiB each, merged into the rows' running top-k lists one tile at a time, so the search's memory does
            not grow with the number of test pairs (see `similarity.blocked_topk`).
        candidate_dim (`int`, *optional*, defaults to `256`):
            Rank of the principal subspace in which the top-k candidates are searched (the block products then
            cost ``candidate_dim / feature width`` of the full ones); the leading ``rescore_top`` candidates of each
            row are then re-scored in the full space. ``None`` searches the full space exactly, like the
            reference (always so with ``reference_compat=True``). The subspace search is approximate: it can miss
            part of the exact top-k and, less often, a row's exact best candidate. Set ``candidate_check_rows`` to
            measure its recall on your data (figures for YAGO-WIKI20K: ``bench/tea/README.md``).
        rescore_top (`int`, *optional*, defaults to `64`):
            Candidates per row whose score is recomputed in the full space after the subspace search (fp32
            arithmetic; when the search runs in bf16 the candidate rows are read as fp16, which halves the bytes of
            this memory-bound gather at a small rounding error, see `lowrank_topk`); at the Sinkhorn temperature of
            0.02 they carry almost all of a row's mass.
        featureless_rows (`str`, *optional*, defaults to `"exclude"`):
            What happens to source entities without any fact (so without structural features and time stamps):
            every candidate ties for them, so which ``top_k`` candidates a top-k keeps is arbitrary. ``"exclude"``
            keeps them out of the Sinkhorn normalisation (their scores are 0 and they count as misses unless a
            tie-break lands on the truth), so they take no column mass from entities that can be aligned;
            ``"include"`` normalises them with the rest, as the reference does (always so with
            ``reference_compat=True``), which makes the metrics depend on how the top-k orders ties.
        matmul_precision (`str`, *optional*, defaults to `"auto"`):
            Dtype of the two large approximate products, the subspace candidate search and the triple view's random
            projections: ``"bfloat16"``, ``"float32"``, ``"int8"`` (the candidate search's block products in int8
            with per-row scales and int32 accumulation on CPU, the projections in fp32), or ``"auto"`` (bf16 on CUDA and
            on CPUs that multiply bf16 natively, AMX or AVX512-BF16; fp32 elsewhere). The triple view's fp32
            products read their inputs (rows of the propagated labels) from fp16 storage: half the memory and the
            bytes read, at fp16 rounding of row-normalised values. Exact re-scoring, Sinkhorn and evaluation stay
            fp32; ``reference_compat=True`` uses fp32 throughout.
        feature_dtype (`str`, *optional*, defaults to `"auto"`):
            Storage dtype of the per-aspect and fused entity features, the largest matrices of a run (test rows x
            ``mini_dim * aspect_dim``): ``"float16"`` halves them (sums, norms, products and scores still run in
            fp32; only the stored values are rounded), ``"float32"`` keeps them full width, ``"auto"`` stores fp16
            when the subspace search is used (``candidate_dim`` below the feature width), whose candidates are
            re-scored from fp16 rows anyway, and a feature matrix would take at least
            `engine.FP16_FEATURES_MIN_BYTES` in fp32, and fp32 otherwise; ``reference_compat=True`` always keeps fp32.
        candidate_search (`str`, *optional*, defaults to `"auto"`):
            How the top-k candidates are searched: ``"exact"`` (PyTorch blocked search, quadratic in the test pairs;
            in the principal subspace when ``candidate_dim`` is set), ``"faiss"`` (an inverted-file index over the
            same subspace, `tea_pipeline.ann.ivf_topk`; needs ``pip install hf-scale-plugins[scale]``) or
            ``"auto"``: faiss from ``faiss_min_rows`` test pairs on when it is installed, exact otherwise. The
            leading ``rescore_top`` candidates are re-scored in full width either way; ``reference_compat=True``
            always searches exactly.
        faiss_min_rows (`int`, *optional*, defaults to `1000000`):
            Test pairs from which ``candidate_search="auto"`` uses faiss. At the default ``faiss_nprobe`` the index
            finds far fewer of the exact search's best candidates on YAGO-WIKI50K-like synthetic pairs (H@1 0.70
            against 0.98 at 1x, bench/tea/README.md), so ``auto`` keeps the exact search through 10x YAGO-WIKI50K
            (441,720 test pairs, which the exact search aligns on a 2-core, 24 GB machine) and switches only beyond
            the sizes where the quadratic search was measured to fit.
        faiss_nlist (`int`, *optional*):
            Inverted lists of the faiss index; ``None`` picks about ``4 sqrt(test pairs)``.
        faiss_nprobe (`int`, *optional*, defaults to `32`):
            Lists scanned per row: more is closer to the exact search and slower.
        candidate_check_rows (`int`, *optional*, defaults to `0`):
            When > 0 and the subspace search is used, this many seeded random rows per round are also searched
            exactly and the recall of the candidate sets is reported in ``RoundMetrics.candidate_recall``.

    > Parameters that control temporal iterative learning

    Parameters:
        rounds (`int`, *optional*, defaults to `3`):
            Rounds of label propagation + alignment; rounds after the first add confident pseudo seeds.
        pseudo_seed_threshold (`float`, *optional*, defaults to `0.8`):
            A source entity becomes a pseudo seed when its best Sinkhorn score exceeds this value.

    > Parameters that control data, reproducibility and compatibility

    Parameters:
        unknown_time_id (`int`, *optional*):
            Time id that means "unknown" and is left out of the temporal similarity. ``None`` detects it from
            ``time_id`` (id 0 labelled ``-inf`` in YAGO-WIKI); ICEWS has none, so its first day counts.
        seed (`int`, *optional*, defaults to `12306`):
            Seed of every random draw (labels, projections, tie breaks); each round and purpose gets its own
            stream derived from it, so one more pseudo seed changes only its own label.
        reuse_freed_memory (`bool`, *optional*, defaults to `True`):
            While `LightTEA.fit` runs, keep freed memory in the process for the next allocation instead of
            returning it to the OS after every use (glibc only; restored and trimmed when ``fit`` returns). A round
            reallocates large temporaries many times, and each fresh page costs a page fault; see
            `tea_pipeline.memory`. Peak RSS can grow a little.
        reuse_freed_memory_max_entities (`int`, *optional*, defaults to `500000`):
            ``reuse_freed_memory`` applies to pairs with at most this many entities. On larger pairs freed memory
            goes back to the OS at once: there the memory kept between reuses (holes the next, differently shaped
            allocations do not fit) adds gigabytes to the peak RSS, while page faults are a small share of a run
            whose search grows quadratically.
        kept_memory_gb (`float`, *optional*, defaults to `4.0`):
            With ``reuse_freed_memory``: when more than this many GB of freed memory are kept as a stage starts,
            all of it goes back to the OS, so what one stage freed does not add to the next stage's peak RSS
            (`tea_pipeline.memory.trim_freed_memory`).
        device (`str`, *optional*, defaults to `"auto"`):
            ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        reference_compat (`bool`, *optional*, defaults to `False`):
            Reproduce the reference code's quirks: relation ids receive time stamps in the temporal similarity,
            the round-1 pseudo-seed time similarity is misaligned, time id 0 is always dropped, ``top_k`` shrinks
            for good once the candidate pool is smaller, ties go to the first candidate.
    """

    dim: int = field(default=256, metadata={"help": "Width d of the random seed labels (reference: 512)."})
    lp_steps: int = field(default=2, metadata={"help": "Label-propagation steps (reference: 2)."})
    aspect_dim: int | None = field(
        default=None, metadata={"help": "D_x; None = dim//2 for ICEWS-like data, dim//3 otherwise."}
    )
    mini_dim: int = field(default=8, metadata={"help": "Width of each triple-view projection (reference: 16)."})
    alpha: float = field(default=0.6, metadata={"help": "Weight of the temporal aspect."})
    fusion: str = field(default="sum", metadata={"help": "Aspect fusion: 'sum' (reference) or 'concat'."})
    top_k: int = field(default=500, metadata={"help": "Candidates per source entity."})
    beta: float = field(default=0.4, metadata={"help": "Weight of the temporal similarity."})
    sinkhorn_temperature: float = field(default=0.02, metadata={"help": "Sinkhorn temperature."})
    sinkhorn_iterations: int = field(default=15, metadata={"help": "Sinkhorn iterations."})
    tie_break: str = field(default="random", metadata={"help": "Evaluation tie break: 'random' or 'first'."})
    block_rows: int = field(default=2048, metadata={"help": "Rows per similarity block (memory bound)."})
    candidate_dim: int | None = field(
        default=256, metadata={"help": "Rank of the subspace searched for top-k candidates (None or >= the feature "
                                          "width: exact search)."})
    rescore_top: int = field(default=64, metadata={"help": "Leading candidates per row re-scored in full width."})
    featureless_rows: str = field(
        default="exclude", metadata={"help": "Source entities without facts: 'exclude' them from Sinkhorn or "
                                             "'include' them (the reference)."})
    matmul_precision: str = field(
        default="auto", metadata={"help": "Approximate products: 'auto', 'bfloat16', 'float32' or 'int8' (int8 "
                                          "search, fp32 projections)."})
    feature_dtype: str = field(
        default="auto", metadata={"help": "Storage dtype of the features: 'auto', 'float16' or 'float32'."})
    candidate_search: str = field(
        default="auto", metadata={"help": "Candidate search: 'auto', 'exact' or 'faiss' (optional extra [scale])."})
    faiss_min_rows: int = field(
        default=1_000_000, metadata={"help": "Test pairs from which candidate_search='auto' uses faiss."})
    faiss_nlist: int | None = field(
        default=None, metadata={"help": "Inverted lists of the faiss index (None: about 4 sqrt(test pairs))."})
    faiss_nprobe: int = field(default=32, metadata={"help": "Inverted lists scanned per row by faiss."})
    candidate_check_rows: int = field(
        default=0, metadata={"help": "Rows per round checked against the exact top-k (recall diagnostics)."})
    rounds: int = field(default=3, metadata={"help": "Temporal iterative learning rounds."})
    pseudo_seed_threshold: float = field(default=0.8, metadata={"help": "Sinkhorn score needed for a pseudo seed."})
    unknown_time_id: int | None = field(
        default=None, metadata={"help": "Time id meaning 'unknown' (None: detect from time_id labels)."}
    )
    seed: int = field(default=12306, metadata={"help": "Seed of every random draw."})
    reuse_freed_memory: bool = field(
        default=True, metadata={"help": "Keep freed memory for reuse while fit runs (fewer page faults)."})
    reuse_freed_memory_max_entities: int = field(
        default=500_000, metadata={"help": "reuse_freed_memory applies to pairs with at most this many entities."})
    kept_memory_gb: float = field(
        default=4.0, metadata={"help": "Freed memory (GB) kept from one stage into the next with reuse_freed_memory."})
    device: str = field(default="auto", metadata={"help": "'auto', 'cpu', 'cuda' or 'cuda:N'."})
    reference_compat: bool = field(default=False, metadata={"help": "Reproduce the reference code's quirks."})

    def __post_init__(self) -> None:
        self.fusion = str(self.fusion).lower()
        self.tie_break = str(self.tie_break).lower()
        self.device = str(self.device).lower()
        self.matmul_precision = {"bf16": "bfloat16", "fp32": "float32"}.get(str(self.matmul_precision).lower(),
                                                                            str(self.matmul_precision).lower())
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"LightTEAConfig.matmul_precision={self.matmul_precision!r} is not supported: use one "
                             f"of {MATMUL_PRECISIONS}.")
        self.feature_dtype = {"fp16": "float16", "half": "float16", "fp32": "float32"}.get(
            str(self.feature_dtype).lower(), str(self.feature_dtype).lower())
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"LightTEAConfig.feature_dtype={self.feature_dtype!r} is not supported: use one of "
                             f"{FEATURE_DTYPES}.")
        self.candidate_search = str(self.candidate_search).lower()
        if self.candidate_search not in CANDIDATE_SEARCHES:
            raise ValueError(f"LightTEAConfig.candidate_search={self.candidate_search!r} is not supported: use one "
                             f"of {CANDIDATE_SEARCHES}.")
        if self.reference_compat:
            # The reference ranks ties by candidate position and always runs 2 LP steps.
            self.tie_break = "first"
        positive_ints = ("dim", "lp_steps", "mini_dim", "top_k", "sinkhorn_iterations", "block_rows", "rounds",
                         "faiss_min_rows", "faiss_nprobe")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LightTEAConfig.{name}={value!r} is invalid: it must be a positive integer. "
                                 f"Set {name} to 1 or more (default {_default(name)}).")
        if self.aspect_dim is not None and (not isinstance(self.aspect_dim, int) or self.aspect_dim < 1):
            raise ValueError(f"LightTEAConfig.aspect_dim={self.aspect_dim!r} is invalid: it must be a positive "
                             "integer or None (None picks dim//2 for ICEWS-like data, dim//3 otherwise).")
        if self.candidate_dim is not None and (not isinstance(self.candidate_dim, int)
                                               or isinstance(self.candidate_dim, bool) or self.candidate_dim < 1):
            raise ValueError(f"LightTEAConfig.candidate_dim={self.candidate_dim!r} is invalid: it must be a positive "
                             "integer (rank of the candidate search space) or None for the exact full search.")
        if self.faiss_nlist is not None and (not isinstance(self.faiss_nlist, int)
                                             or isinstance(self.faiss_nlist, bool) or self.faiss_nlist < 1):
            raise ValueError(f"LightTEAConfig.faiss_nlist={self.faiss_nlist!r} is invalid: it must be a positive "
                             "integer (inverted lists of the faiss index) or None for about 4 sqrt(test pairs).")
        for name in ("rescore_top", "candidate_check_rows", "reuse_freed_memory_max_entities"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LightTEAConfig.{name}={value!r} is invalid: it must be an integer >= 0 "
                                 f"(default {_default(name)}).")
        if isinstance(self.kept_memory_gb, bool) or not float(self.kept_memory_gb) >= 0:
            raise ValueError(f"LightTEAConfig.kept_memory_gb={self.kept_memory_gb!r} is invalid: it is the freed "
                             "memory (GB) kept from one stage into the next and must be >= 0 (0: keep none).")
        self.kept_memory_gb = float(self.kept_memory_gb)
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"LightTEAConfig.{name}={value!r} is invalid: it is a mixing weight and must lie "
                                 f"in [0, 1]. The reference uses {_default(name)}.")
        if not self.sinkhorn_temperature > 0:
            raise ValueError(f"LightTEAConfig.sinkhorn_temperature={self.sinkhorn_temperature!r} is invalid: "
                             "scores are divided by it, so it must be > 0 (reference: 0.02).")
        if not 0.0 < float(self.pseudo_seed_threshold) < 1.0:
            raise ValueError(f"LightTEAConfig.pseudo_seed_threshold={self.pseudo_seed_threshold!r} is invalid: "
                             "Sinkhorn scores lie in (0, 1], so use a value in (0, 1) (reference: 0.8).")
        if self.fusion not in FUSIONS:
            raise ValueError(f"LightTEAConfig.fusion={self.fusion!r} is not supported: use one of {FUSIONS}.")
        if self.featureless_rows not in FEATURELESS_ROWS:
            raise ValueError(f"LightTEAConfig.featureless_rows={self.featureless_rows!r} is not supported: use one "
                             f"of {FEATURELESS_ROWS}.")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"LightTEAConfig.tie_break={self.tie_break!r} is not supported: use one of "
                             f"{TIE_BREAKS}.")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"LightTEAConfig.device={self.device!r} is not supported: use 'auto', 'cpu', 'cuda' "
                             "or 'cuda:N'.")
        if self.reference_compat and self.lp_steps != 2:
            raise ValueError(f"LightTEAConfig.lp_steps={self.lp_steps} conflicts with reference_compat=True: the "
                             "reference code always runs 2 steps. Set lp_steps=2 or reference_compat=False.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LightTEAConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown LightTEAConfig keys {unknown}; valid keys are {sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> LightTEAConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _default(name: str) -> Any:
    return next(f.default for f in fields(LightTEAConfig) if f.name == name)
