"""Labelled workloads: deterministic, complete, consistently labelled, and never on disk."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from semkv import assets
from semkv.eval import (
    KINDS,
    LATER_KINDS,
    WRAPPER_STYLES,
    ClusterKind,
    Prompt,
    Workload,
    WorkloadSizeError,
    build_workload,
    chat,
    chat_wrap,
)
from semkv.span_plan import plan_span
from tests.eval_tokenizers import bpe, words

try:
    assets.essays_dir()
    assets.wiki_file()
except assets.MissingAssetError as exc:  # pragma: no cover - depends on the install
    pytest.skip(f"offline corpora not installed: {exc}", allow_module_level=True)






@pytest.fixture(scope="module")
def workload() -> Workload:
    return build_workload(7, clusters_per_type=3, target_tokens=512)


def _common_run(a: list[int] | str, b: list[int] | str) -> int:
    match = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match()
    return int(match.size)


def test_deterministic_for_a_seed() -> None:
    first = build_workload(11, clusters_per_type=2, target_tokens=400)
    assert first == build_workload(11, clusters_per_type=2, target_tokens=400)
    other = build_workload(12, clusters_per_type=2, target_tokens=400)
    assert [p.text for p in first.targets] != [p.text for p in other.targets]


def test_every_kind_is_present(workload: Workload) -> None:
    assert workload.kinds == KINDS
    assert {p.kind for p in workload.targets} == set(KINDS)
    negatives_without_donor = {ClusterKind.NEGATIVE_UNRELATED}
    assert {p.kind for p in workload.donors} == set(KINDS) - negatives_without_donor
    for kind in KINDS:
        assert sum(p.kind is kind for p in workload.targets) == 3


def test_labels_and_true_donors_are_consistent(workload: Workload) -> None:
    donors = {p.prompt_id: p for p in workload.donors}
    assert len(donors) == len(workload.donors)
    assert all(p.true_donor_id is None and p.role == "donor" for p in workload.donors)
    for target in workload.targets:
        assert target.role == "target" and target.prompt_id.startswith(target.cluster_id)
        if target.kind.is_negative:
            assert target.true_donor_id is None
            continue
        donor = donors[target.true_donor_id]  # type: ignore[index]
        assert donor.cluster_id == target.cluster_id and donor.kind is target.kind
        if target.kind is ClusterKind.MULTI_PASSAGE_RAG:
            # One passage per donor, every passage from another donor, all of them in the target.
            meant = [donors[d] for d in target.metadata["donor_ids"]]
            assert target.true_donor_id == meant[0].prompt_id and len(meant) >= 3
            assert all(d.cluster_id == target.cluster_id for d in meant)
            assert [d.metadata["doc_ids"][0] for d in meant] == target.metadata["doc_ids"]
            assert target.metadata["order"] != sorted(target.metadata["order"])
            assert {d.prompt_id for d in donors.values() if d.cluster_id == target.cluster_id} \
                == set(target.metadata["donor_ids"])
            continue
        if target.kind is ClusterKind.QUOTED_SECTION:  # the donor's document, quoted in another
            assert target.metadata["doc_ids"][1:] == donor.metadata["doc_ids"]
            assert target.metadata["donor_ids"] == [target.true_donor_id]
            continue
        assert donor.metadata["doc_ids"] == target.metadata["doc_ids"] or (
            target.kind is ClusterKind.REORDERED_CHUNKS
            and sorted(donor.metadata["doc_ids"]) == sorted(target.metadata["doc_ids"])
        )
        if target.kind in LATER_KINDS:  # the newer kinds say what they are meant to reuse
            assert target.metadata["donor_ids"] == [target.true_donor_id]
        if target.kind is ClusterKind.CROSS_INSTRUCTION_TASK_FIRST:
            assert target.metadata["task"] != donor.metadata["task"]
            assert target.metadata["donor_task"] == donor.metadata["task"]
            assert (target.metadata["system"], target.metadata["style"]) == (
                donor.metadata["system"], donor.metadata["style"])


def test_later_kinds_label_their_expected_tier(workload: Workload) -> None:
    for target in workload.targets:
        if target.kind in LATER_KINDS:
            assert target.metadata["expected_tier"] == "verified"
        else:
            assert "expected_tier" not in target.metadata


def test_later_kinds_leave_every_other_cluster_unchanged(workload: Workload) -> None:
    """The kinds added later do not change the prompts (or order) of the others for a seed."""
    earlier = build_workload(7, clusters_per_type=3, target_tokens=512,
                             kinds=[k for k in KINDS if k not in LATER_KINDS])
    assert earlier.donors == tuple(p for p in workload.donors if p.kind not in LATER_KINDS)
    assert earlier.targets == tuple(p for p in workload.targets if p.kind not in LATER_KINDS)


def test_documents_are_never_shared_across_clusters(workload: Workload) -> None:
    owner: dict[str, str] = {}
    for prompt in (*workload.donors, *workload.targets):
        for doc_id in prompt.metadata["doc_ids"]:
            assert owner.setdefault(doc_id, prompt.cluster_id) == prompt.cluster_id, doc_id


def test_same_topic_negative_shares_the_label_not_the_document(workload: Workload) -> None:
    negatives = [p for p in workload.targets if p.kind is ClusterKind.NEGATIVE_SAME_TOPIC]
    for target in negatives:
        decoy = workload.prompt(target.metadata["decoy_donor_id"])
        assert decoy.role == "donor" and decoy.metadata["topic"] == target.metadata["topic"]
        assert not set(decoy.metadata["doc_ids"]) & set(target.metadata["doc_ids"])
        assert target.metadata["topic"] != "Uncategorized"


def test_unrelated_negative_shares_no_essay_with_any_donor(workload: Workload) -> None:
    used = {s for p in workload.donors for s in p.metadata["sources"]}
    for target in workload.targets:
        if target.kind is ClusterKind.NEGATIVE_UNRELATED:
            assert not used & set(target.metadata["sources"])


def test_shared_text_is_where_the_cluster_says(workload: Workload) -> None:
    for target in workload.targets:
        if target.true_donor_id is None:
            continue
        donor = workload.prompt(target.true_donor_id)
        if target.kind is ClusterKind.EXACT_CONTROL:
            assert donor.text == target.text
        elif target.kind is ClusterKind.MULTI_PASSAGE_RAG:  # each donor's passage, verbatim
            for donor_id in target.metadata["donor_ids"]:
                one = workload.prompt(donor_id)
                question = chat.DOC_QUESTIONS[one.metadata["question"]]
                after = one.text.split(f"{chat.DOC_INSTRUCTION}\n\n", 1)[1]
                passage = after.split(f"\n\n{question}", 1)[0]
                assert f"\n\n{passage}\n\n" in target.text and len(passage) > 200
        elif target.kind is ClusterKind.PARTIAL_OVERLAP:
            assert _prefix(donor.text, target.text) > 0.8 * len(target.text)
        else:  # the document (or its unedited rest, or one passage) is shared verbatim
            assert _common_run(donor.text, target.text) > 200


def _prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_length_control_with_a_tokenizer() -> None:
    wl = build_workload(3, clusters_per_type=2, target_tokens=600, tokenizer=words)
    for prompt in (*wl.donors, *wl.targets):
        assert prompt.token_ids is not None and prompt.token_ids == tuple(words(prompt.text))
        want = 600
        if prompt.kind is ClusterKind.MULTI_PASSAGE_RAG and prompt.role == "donor":
            want = 600 // len(wl.prompt(f"{prompt.cluster_id}/target").metadata["donor_ids"])
        assert 0.7 * want <= len(prompt.token_ids) <= 1.25 * want + 40, prompt  # 40: furniture


def test_shared_content_is_token_identical_under_bpe() -> None:
    tok = bpe()
    wl = build_workload(5, clusters_per_type=2, target_tokens=1024, tokenizer=tok)
    for target in wl.targets:
        if target.true_donor_id is None:
            continue
        donor = wl.prompt(target.true_donor_id)
        a, b = list(donor.token_ids or ()), list(target.token_ids or ())
        run = _common_run(a, b)
        if target.kind is ClusterKind.REORDERED_CHUNKS:
            assert run >= 60, target  # at least one whole passage
        elif target.kind is ClusterKind.MULTI_PASSAGE_RAG:
            assert run >= 0.8 * (len(a) - 60), target  # the donor's whole passage
        elif target.kind is ClusterKind.QUOTED_SECTION:
            assert run >= 0.25 * len(b), (target, run, len(b))  # the quoted section
        else:  # the whole document, less the edited lead-in lines where there are some
            assert run >= 0.8 * len(b), (target, run, len(b))


def _span_plans(wl: Workload, kind: ClusterKind) -> list[tuple[Prompt, int, list[str]]]:
    """Each target of ``kind``: copied tokens and donors of its span plan from the donors it
    is meant to reuse (no local prefix: nothing of it is in the engine's prefix cache)."""
    out = []
    for target in (t for t in wl.targets if t.kind is kind):
        donors = {d: list(wl.prompt(d).token_ids or ()) for d in target.metadata["donor_ids"]}
        plan = plan_span(list(target.token_ids or ()), donors, local_tokens=0, block_size=16)
        assert plan is not None, target
        out.append((target, plan.copied_tokens, list(plan.donors)))
    return out


@pytest.mark.parametrize("tokenizer", ["words", "bpe"])
def test_segmented_kinds_are_served_by_span_plans(tokenizer: str) -> None:
    tok = words if tokenizer == "words" else bpe()
    wl = build_workload(5, clusters_per_type=2, target_tokens=1024, tokenizer=tok)
    for target, copied, used in _span_plans(wl, ClusterKind.MULTI_PASSAGE_RAG):
        assert len(used) >= 2, target  # several donors, together >= half of the prompt

        assert copied >= 0.5 * len(target.token_ids or ()), (target, copied)
    for target, copied, used in _span_plans(wl, ClusterKind.CROSS_INSTRUCTION_TASK_FIRST):
        assert used == [target.true_donor_id], target  # the document, after a computed task
        assert copied >= 0.8 * len(target.token_ids or ()), (target, copied)


def test_chat_wrap_styles() -> None:
    texts = {style: chat_wrap("SYS", "USER", style) for style in WRAPPER_STYLES}
    assert len(set(texts.values())) == len(WRAPPER_STYLES)
    for text in texts.values():
        assert "SYS" in text and "\nUSER" in text  # the user message starts on a new line
    with pytest.raises(ValueError):
        chat_wrap("s", "u", "nope")  # type: ignore[arg-type]


def test_repr_and_summary_carry_no_text(workload: Workload) -> None:
    prompt: Prompt = workload.targets[0]
    assert prompt.text[:40] not in repr(prompt) and prompt.text[:40] not in str(workload)
    summary = json.dumps(workload.summary())
    assert all(p.text[:40] not in summary for p in workload.targets)


def test_kind_filter_and_size_errors() -> None:
    wl = build_workload(1, clusters_per_type=1, kinds=["reordered_chunks"])
    assert {p.kind for p in (*wl.donors, *wl.targets)} == {ClusterKind.REORDERED_CHUNKS}
    with pytest.raises(ValueError):
        build_workload(1, clusters_per_type=1, kinds=["no_such_kind"])
    with pytest.raises(WorkloadSizeError):
        build_workload(1, clusters_per_type=40, target_tokens=8192)


def test_no_corpus_text_is_written_to_disk(tmp_path: Path) -> None:
    """Build a workload under an audit hook that records every file opened for writing."""
    code = textwrap.dedent(
        """
        import json, os, sys
        from semkv.eval import build_workload
        written = []
        WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

        def hook(event, args):
            if event == "open":
                path, mode, flags = args
                if (mode and any(c in str(mode) for c in "wax+")) or (flags or 0) & WRITE:
                    written.append(str(path))
            elif event in ("os.rename", "os.replace", "shutil.copyfile", "os.mkdir"):
                written.append(str(args[1] if event.startswith("shutil") else args[0]))

        sys.addaudithook(hook)
        build_workload(2, clusters_per_type=2, target_tokens=300)
        build_workload(2, clusters_per_type=1)
        print(json.dumps(written))
        """
    )
    env = {"HOME": str(tmp_path), "TMPDIR": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, **env}, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert list(tmp_path.iterdir()) == []
