"""Synthetic TKG pairs with a known alignment: two noisy views of one random temporal graph (for tests and demos)."""

from __future__ import annotations

import numpy as np

from .data import TKGPair


def make_synthetic_pair(num_entities: int = 1000, num_relations: int = 12, num_times: int = 60,
                        facts_per_entity: float = 6.0, keep_prob: float = 0.8, unknown_time_prob: float = 0.2,
                        seed_fraction: float = 0.2, seed: int = 0) -> TKGPair:
    """Build one random temporal graph and derive two KGs from it.

    Each KG keeps every fact with probability ``keep_prob`` (independently), gets its own entity-id permutation
    (KG2 ids follow KG1 ids), its own relation ids, and loses a time stamp to "unknown" (time id 0, labelled
    ``-inf`` as in YAGO-WIKI) with probability ``unknown_time_prob``. Facts have a begin and an end time (5-column
    layout). All ``num_entities`` entities are aligned; the pairs come in random order and the first
    ``round(seed_fraction * num_entities)`` are the seeds.
    """
    if num_entities < 10:
        raise ValueError(f"num_entities={num_entities} is too small: use at least 10.")
    if not 0.0 < keep_prob <= 1.0 or not 0.0 <= unknown_time_prob < 1.0 or not 0.0 < seed_fraction < 1.0:
        raise ValueError("keep_prob must be in (0, 1], unknown_time_prob in [0, 1), seed_fraction in (0, 1).")
    rng = np.random.default_rng(seed)
    n = num_entities
    num_facts = int(facts_per_entity * n)
    # Skewed degrees, like real KGs: heads drawn from a Zipf-like distribution, every entity appears at least once.
    weights = 1.0 / np.arange(1, n + 1) ** 0.6
    weights /= weights.sum()
    heads = np.concatenate([np.arange(n), rng.choice(n, num_facts - n, p=weights)])
    tails = rng.choice(n, num_facts, p=weights)
    loop = heads == tails
    tails[loop] = (tails[loop] + 1) % n
    rels = rng.integers(0, num_relations, num_facts)
    begin = rng.integers(1, num_times, num_facts)
    end = np.minimum(begin + rng.integers(0, 5, num_facts), num_times - 1)

    kg_perm = [rng.permutation(n), n + rng.permutation(n)]
    facts = []
    for kg in (0, 1):
        keep = rng.random(num_facts) < keep_prob
        tb, te = begin[keep].copy(), end[keep].copy()
        tb[rng.random(len(tb)) < unknown_time_prob] = 0
        te[rng.random(len(te)) < unknown_time_prob] = 0
        f = np.stack([np.full(keep.sum(), kg + 1), kg_perm[kg][heads[keep]], rels[keep] + kg * num_relations,
                      kg_perm[kg][tails[keep]], tb, te], axis=1)
        facts.append(f)
    order = rng.permutation(n)
    pairs = np.stack([kg_perm[0][order], kg_perm[1][order]], axis=1).astype(np.int64)
    names = [""] * (2 * n)
    for i in range(n):
        names[kg_perm[0][i]] = f"kg1:entity_{i}"
        names[kg_perm[1][i]] = f"kg2:entity_{i}"
    return TKGPair(
        name=f"synthetic-{n}-seed{seed}",
        num_entities=2 * n,
        kg1_entities=np.arange(n),
        kg2_entities=np.arange(n, 2 * n),
        entity_names=names,
        relation_names=[f"kg1:rel_{r}" for r in range(num_relations)] + [f"kg2:rel_{r}" for r in
                                                                           range(num_relations)],
        time_labels=["-inf"] + [str(1900 + t) for t in range(1, num_times)],
        facts=np.concatenate(facts).astype(np.int64),
        pairs=pairs,
        num_seeds=int(round(seed_fraction * n)),
        sources={"alignment": "synthetic"},
    )


# YAGO-WIKI50K as the TEA-GNN paper (Table 1) and our local counts give it (docs/lighttea.md, section 3.3): entities,
# relations and time stamps of the two KGs, facts per KG (paper; the triples files are not held locally), aligned
# pairs and seeds (the 5K split).
YAGO_WIKI50K = {"kg1_entities": 49_629, "kg2_entities": 49_222, "kg1_relations": 11, "kg2_relations": 30,
                "times": 245, "kg1_facts": 221_050, "kg2_facts": 317_814, "pairs": 49_172, "seeds": 5_000}


def make_scaled_pair(scale: float = 1.0, seed: int = 0, keep_prob: float = 0.85, unknown_begin_prob: float = 0.05,
                     unknown_end_prob: float = 0.3, stats: dict[str, int] | None = None) -> TKGPair:
    """A synthetic pair ``scale`` times the size of YAGO-WIKI50K (``stats``), in its proportions.

    Entities, facts, aligned pairs and seeds scale with ``scale``; relations and time stamps (years) do not, as they
    would not in a larger crawl of the same sources. One latent temporal graph over the aligned entities plus each
    KG's own unaligned ones is drawn with skewed (Zipf-like) degrees; KG2 keeps each latent fact with probability
    ``keep_prob`` and KG1 with the probability that gives it its share of the facts (facts touching the other KG's
    unaligned entities are dropped). KG2 uses the 30 latent relations, KG1 folds them onto its 11. Begin years are
    skewed to recent ones, end years follow them; each KG loses a begin (end) year to "unknown" (time 0, ``-inf``)
    with probability ``unknown_begin_prob`` (``unknown_end_prob``). Ids: KG1 entities first, each KG's in its own
    random order; pairs in random order, the first ``scale * seeds`` are the seeds. Vectorised: about 1M entities in
    a few seconds.
    """
    if not scale > 0:
        raise ValueError(f"scale={scale!r} is invalid: it must be > 0 (1.0 = the size of YAGO-WIKI50K).")
    s = dict(YAGO_WIKI50K if stats is None else stats)
    n1, n2, n_pairs = (max(10, round(scale * s[k])) for k in ("kg1_entities", "kg2_entities", "pairs"))
    n_seeds = max(1, round(scale * s["seeds"]))
    f1, f2 = round(scale * s["kg1_facts"]), round(scale * s["kg2_facts"])
    r1, r2, num_times = s["kg1_relations"], s["kg2_relations"], s["times"]
    if not (n_pairs <= min(n1, n2) and n_seeds < n_pairs and 0.0 < keep_prob <= 1.0):
        raise ValueError("stats must have pairs <= entities of each KG and seeds < pairs; keep_prob in (0, 1].")
    rng = np.random.default_rng(seed)
    # Latent entities: [0, n_pairs) aligned, then KG1's own, then KG2's own.
    extra1, extra2 = n1 - n_pairs, n2 - n_pairs
    n_lat = n_pairs + extra1 + extra2
    owner = np.zeros(n_lat, dtype=np.int8)  # 0 both KGs, 1 KG1 only, 2 KG2 only
    owner[n_pairs:n_pairs + extra1], owner[n_pairs + extra1:] = 1, 2
    num_facts = round(max(f1, f2) / keep_prob)
    weights = rng.permutation(1.0 / np.arange(1, n_lat + 1) ** 0.6)
    cdf = np.cumsum(weights / weights.sum())
    draw = lambda m: np.minimum(np.searchsorted(cdf, rng.random(m)), n_lat - 1)  # noqa: E731
    heads = np.concatenate([np.arange(n_lat), draw(num_facts - n_lat)])  # every entity heads one fact at least
    tails = draw(num_facts)
    loop = heads == tails
    tails[loop] = (tails[loop] + 1) % n_lat
    rels = rng.integers(0, r2, num_facts)
    year_w = np.arange(1, num_times, dtype=np.float64) ** 2  # more facts about recent years
    begin = 1 + np.searchsorted(np.cumsum(year_w / year_w.sum()), rng.random(num_facts))
    begin = np.minimum(begin, num_times - 1)
    end = np.minimum(begin + rng.geometric(0.3, num_facts) - 1, num_times - 1)
    kg_ids = []
    for own, n_kg, offset in ((1, n1, 0), (2, n2, n1)):
        ids = np.full(n_lat, -1, dtype=np.int64)
        mine = np.nonzero((owner == 0) | (owner == own))[0]
        ids[mine] = offset + rng.permutation(n_kg)
        kg_ids.append(ids)
    facts = []
    for kg, (f_kg, ids) in enumerate(((f1, kg_ids[0]), (f2, kg_ids[1]))):
        ok = (ids[heads] >= 0) & (ids[tails] >= 0)
        p = min(1.0, f_kg / max(1, int(ok.sum())))
        keep = ok & (rng.random(num_facts) < p)
        m = int(keep.sum())
        tb, te = begin[keep].copy(), end[keep].copy()
        tb[rng.random(m) < unknown_begin_prob] = 0
        te[rng.random(m) < unknown_end_prob] = 0
        rel = rels[keep] % r1 if kg == 0 else r1 + rels[keep]
        facts.append(np.stack([np.full(m, kg + 1), ids[heads[keep]], rel, ids[tails[keep]], tb, te], axis=1))
    order = rng.permutation(n_pairs)
    pairs = np.stack([kg_ids[0][order], kg_ids[1][order]], axis=1)
    names = [f"kg1:e{i}" for i in range(n1)] + [f"kg2:e{i}" for i in range(n2)]
    return TKGPair(
        name=f"synthetic-yago-wiki50k-x{scale:g}-seed{seed}",
        num_entities=n1 + n2,
        kg1_entities=np.arange(n1),
        kg2_entities=np.arange(n1, n1 + n2),
        entity_names=names,
        relation_names=[f"kg1:rel_{r}" for r in range(r1)] + [f"kg2:rel_{r}" for r in range(r2)],
        time_labels=["-inf"] + [str(1770 + t) for t in range(1, num_times)],
        facts=np.concatenate(facts).astype(np.int64),
        pairs=pairs.astype(np.int64),
        num_seeds=n_seeds,
        sources={"alignment": "synthetic", "proportions": "YAGO-WIKI50K (TEA-GNN Table 1)"},
    )
