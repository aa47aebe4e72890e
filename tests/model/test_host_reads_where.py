"""`support.host_reads.where` names a read by its path inside the package, wherever the checkout lives.

A `git clone` of this repository makes a folder named `rollout`, so the package sits at `.../rollout/rollout/`
and every path (tests, the venv) holds "/rollout/": the innermost *package* frame is what a failure must name."""

from support.host_reads import PACKAGE, where


def test_where_names_the_package_frame_in_a_clone_folder_named_rollout():
    package = "/home/user/rollout/rollout/"
    frames = [("/home/user/rollout/tests/model/test_static_decode.py", 140),
              ("/home/user/rollout/rollout/engine/core.py", 20),
              ("/home/user/rollout/rollout/sampling/sampler.py", 107),
              ("/home/user/rollout/.venv/lib/python3.11/site-packages/torch/_tensor.py", 9)]
    assert where(frames, package) == "sampling/sampler.py:107"


def test_where_in_another_folder_and_without_package_frames():
    package = "/ci/checkout/rollout/"
    assert where([("/ci/checkout/rollout/kv/pages.py", 3)], package) == "kv/pages.py:3"
    assert where([("/ci/checkout/tests/x.py", 1)], package) == "?"


def test_the_installed_package_directory_ends_in_rollout():
    assert PACKAGE.rstrip("/").endswith("rollout")
