"""The quoted_section kind (issue #25): another document quoting a donor's section elsewhere.

What must hold: the target carries a contiguous section of its donor's document verbatim, not
the donor's first line, not at the target's start and not at the donor's (relative or absolute)
offset; everything else in it is text no donor has; its plan is one donor's section, shifted,
among computed gaps (``gap_dominated``); and adding the kind changes no other kind's clusters.
"""

from __future__ import annotations

import difflib
import random

import pytest

from semkv import assets
from semkv.eval import (
    KINDS,
    ClusterKind,
    Prompt,
    Workload,
    WorkloadSizeError,
    build_workload,
    chat,
)
from semkv.eval.context import Context
from semkv.eval.corpus import essay_documents
from semkv.eval.segmented import MIN_SHIFT, quoted_section
from semkv.plan_class import PlanClass, plan_class
from semkv.span_plan import plan_span
from tests.eval_tokenizers import bpe, words

try:
    assets.essays_dir()
    assets.wiki_file()
except assets.MissingAssetError as exc:  # pragma: no cover - depends on the install
    pytest.skip(f"offline corpora not installed: {exc}", allow_module_level=True)

QUOTED = ClusterKind.QUOTED_SECTION






@pytest.fixture(scope="module")
def workload() -> Workload:
    return build_workload(7, clusters_per_type=3, target_tokens=512)


def _targets(wl: Workload) -> list[Prompt]:
    found = [t for t in wl.targets if t.kind is QUOTED]
    assert found
    return found


def _material(prompt: Prompt, instruction: str) -> str:
    """The document a prompt carries: between its instruction and its question."""
    question = chat.DOC_QUESTIONS[prompt.metadata["question"]]
    return prompt.text.split(f"{instruction}\n\n", 1)[1].rsplit(f"\n\n{question}", 1)[0]


def _parts(wl: Workload, target: Prompt) -> tuple[str, str, str, str]:
    """The donor's document, the target's document, the quoted section, the host text."""
    donor = wl.prompt(target.true_donor_id or "")
    source = _material(donor, chat.DOC_INSTRUCTION)
    variant = chat.DOC_INSTRUCTION_PARAPHRASES[target.metadata["instruction_variant"]]
    material = _material(target, variant)
    a, b = target.metadata["quoted_lines"]
    section = "\n".join(source.split("\n")[a:b])
    host = material.replace(f"\n\n{section}\n\n", "\n", 1)
    return source, material, section, host


def _common_run(a: str, b: str) -> int:
    match = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match()
    return int(match.size)


def test_labels_name_the_one_donor(workload: Workload) -> None:
    for target in _targets(workload):
        donor = workload.prompt(target.true_donor_id or "")
        assert donor.role == "donor" and donor.kind is QUOTED and not QUOTED.is_negative
        assert donor.cluster_id == target.cluster_id
        assert [d.prompt_id for d in workload.donors if d.cluster_id == target.cluster_id] \
            == [donor.prompt_id]
        assert target.metadata["donor_ids"] == [donor.prompt_id]
        assert target.metadata["expected_tier"] == "verified"
        host_doc, quoted_doc = target.metadata["doc_ids"]
        assert quoted_doc == target.metadata["quoted_doc_id"] == donor.metadata["doc_ids"][0]
        assert all(host_doc not in d.metadata["doc_ids"] for d in workload.donors)
        # another system prompt, wrapper and question than the donor's
        for key in ("system", "style", "question"):
            assert target.metadata[key] != donor.metadata[key], key


def test_the_section_is_quoted_verbatim_at_another_place(workload: Workload) -> None:
    for target in _targets(workload):
        donor = workload.prompt(target.true_donor_id or "")
        source, material, section, _ = _parts(workload, target)
        assert len(section) > 300
        assert f"\n{section}\n" in f"{source}\n" and not source.startswith(section)
        assert material.count(f"\n\n{section}\n\n") == 1  # between blank lines, host around it
        at_donor = source.index(f"\n{section}") + 1
        at_target = material.index(f"\n\n{section}\n\n") + 2
        assert at_target > 0.05 * len(material)  # not at the host document's start
        assert len(material) - at_target - len(section) > 0.05 * len(material)  # nor its end
        assert abs(at_target / len(material) - at_donor / len(source)) >= MIN_SHIFT - 0.01
        assert abs(target.text.index(section) - donor.text.index(section)) > 100  # chars
        assert 0.3 <= len(section) / len(target.text) <= 0.5, target.metadata["section_share"]


def test_nothing_but_the_section_is_shared_with_any_donor(workload: Workload) -> None:
    for target in _targets(workload):
        _, _, section, host = _parts(workload, target)
        for donor in workload.donors:
            # chat furniture aside (system prompts, at most ~180 chars), no long common run
            assert _common_run(host, donor.text) < 120, (target, donor)
            if donor.prompt_id != target.true_donor_id:
                assert _common_run(section, donor.text) < 120, (target, donor)


def test_adding_the_kind_leaves_every_other_cluster_unchanged(workload: Workload) -> None:
    without = build_workload(7, clusters_per_type=3, target_tokens=512,
                             kinds=[k for k in KINDS if k is not QUOTED])
    assert without.donors == tuple(p for p in workload.donors if p.kind is not QUOTED)
    assert without.targets == tuple(p for p in workload.targets if p.kind is not QUOTED)


@pytest.mark.parametrize(("tokenizer", "target_tokens"),
                         [("words", 600), ("bpe", 512), ("bpe", 1024)])
def test_the_plan_is_one_shifted_section_among_gaps(tokenizer: str, target_tokens: int) -> None:
    tok = words if tokenizer == "words" else bpe()
    wl = build_workload(5, clusters_per_type=3, target_tokens=target_tokens, tokenizer=tok,
                        kinds=[QUOTED])
    for target in _targets(wl):
        donor = wl.prompt(target.true_donor_id or "")
        ids, donor_ids = list(target.token_ids or ()), list(donor.token_ids or ())
        # as the engine holds the donor (whole blocks of 32) and serves the target: no prefix
        plan = plan_span(ids, {donor.prompt_id: donor_ids[: len(donor_ids) // 32 * 32]},
                         local_tokens=0, block_size=32)
        assert plan is not None and plan_class(plan) is PlanClass.GAP_DOMINATED, target
        runs = sorted((s for s in plan.segments if not s.is_gap), key=lambda s: -s.length)
        quoted = len(tok(_parts(wl, target)[2]))
        assert runs[0].length >= 0.9 * quoted and runs[0].shifted, (target, runs[0])
        assert sum(r.length for r in runs[1:]) < 0.05 * len(ids), (target, runs)
        assert 0.3 * len(ids) <= plan.copied_tokens <= 0.5 * len(ids), (target, plan.summary())


def _context(seed: int, chars: int) -> Context:
    rng = random.Random(seed)
    return Context(rng=rng, tokenizer=None, essay_docs=essay_documents(rng, chars), leads={},
                   doc_tokens=chars // 4, essay_chars_per_token=4.0, wiki_chars_per_token=4.0)


@pytest.mark.parametrize("share", [0.3, 0.5])
def test_the_section_share_is_configurable(share: float) -> None:
    ctx = _context(3, 6000)
    for k in range(3):
        _, target = quoted_section(ctx, k, share=share)
        assert abs(target.metadata["section_share"] - share) < 0.06, target.metadata


def test_bad_share_and_too_short_documents_are_errors() -> None:
    for share in (0.0, 1.0):
        with pytest.raises(ValueError):
            quoted_section(_context(3, 6000), 0, share=share)
    with pytest.raises(WorkloadSizeError):  # a line or two per document: nowhere to quote
        quoted_section(_context(3, 100), 0)
