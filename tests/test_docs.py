"""The README is a manual (issue 28): within 20 KB, no history or target words; measurements live in docs/."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 20 * 1024
# words of a lab notebook, not of a manual: "round 2", "this round", "before this round", "(target 1.15x)"
NOTEBOOK_WORDS = re.compile(r"\bround \d|\b(this|last|next|previous|that) round\b|\(target\b|\btarget \d", re.I)


def test_readme_is_a_manual_within_20_kb_without_round_or_target_words():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= README_MAX_BYTES
    assert NOTEBOOK_WORDS.findall(text) == []


def test_the_notebook_pattern_catches_what_it_bans():
    for words in ("as in round 2", "before this round", "AL 1.64x (target 1.15x)", "target 0.75x"):
        assert NOTEBOOK_WORDS.search(words), words
    assert not NOTEBOOK_WORDS.search("the verifier's target token; d2t maps draft to target ids")


def test_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    missing = [link for link in re.findall(r"\]\(([^)#]+)", text)
               if not link.startswith("http") and not (REPO / link).exists()]
    assert missing == []


def test_the_product_points_at_nothing_outside_the_repository():
    """A user's clone has only the repository: no product file (code, docs, configs, scripts) may send the
    reader to a `shared/reference` folder that lives beside it in the workplace (docs/vllm_contract.md holds
    the contract in the project's own words)."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    product = [f for f in files.split() if not f.startswith((".ci/", "tests/"))]
    pointing = [f for f in product if "shared/reference" in (REPO / f).read_text(errors="replace")]
    assert pointing == []
    assert (REPO / "docs" / "vllm_contract.md").is_file()
