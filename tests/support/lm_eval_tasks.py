"""Two lm-evaluation-harness tasks of our own on local JSON data (no hub): a loglikelihood
(multiple-choice) task and a generate_until task, written as YAML under a folder given to lm-eval's
`TaskManager(include_path=...)`."""

from __future__ import annotations

import json
from pathlib import Path

MC_DOCS = [
    {"question": "abc", "choices": ["d", "x", "e f"], "label": 0},
    {"question": "the cat sat on the", "choices": [" mat", " dog", " hat"], "label": 0},
    {"question": "1 2 3", "choices": [" 4", " 5", " 9 9"], "label": 0},
    {"question": "red green", "choices": [" blue", " tree", "!"], "label": 0},
    {"question": "hello", "choices": [" world", " there", "?"], "label": 1},
    {"question": "x y", "choices": [" z", " w", " a b c"], "label": 2},
]
GEN_DOCS = [
    {"question": "12+3=", "answer": "15"},
    {"question": "The sky is", "answer": " blue"},
    {"question": "a b c d", "answer": " e"},
    {"question": "count: 1 2", "answer": " 3"},
]

MC_YAML = """task: rollout_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """task: rollout_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path) -> tuple[Path, list[str]]:
    """Write both tasks and their data under `folder`; returns (include_path, task names)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs, yaml in (("mc", MC_DOCS, MC_YAML), ("gen", GEN_DOCS, GEN_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"rollout_tiny_{name}.yaml").write_text(yaml.format(data=data))
    return folder, ["rollout_tiny_mc", "rollout_tiny_gen"]
