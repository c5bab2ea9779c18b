"""One table of verl releases: every built-in patch set is registered from it, one per release
and engine, and the CPU test support knows exactly its releases. Needs no verl (the patch-set
modules import none at their top level)."""

from prefix_sharing.releases import VERL_RELEASES, verl_patchsets
from prefix_sharing.testing.verl_cpu.patches import RELEASE_PATCHES
from prefix_sharing.verl_ext.patchsets import registered


def test_the_registered_patch_sets_are_the_tables_releases_and_engines():
    known = registered()
    expected = {f"verl{release.replace('.', '')}_{engine}": release
                for release, engines in VERL_RELEASES.items() for engine in engines}
    assert {name: ps.verl_versions for name, ps in known.items()} == {
        name: (release,) for name, release in expected.items()}
    assert {"verl091_mcore", "verl080_fsdp", "verl080_mcore_mindspeed"} <= set(known)
    for name, ps in known.items():
        assert ps.verl_versions[0] in ps.summary and ps.hooks, name


def test_patchset_names_follow_the_release_digits():
    assert verl_patchsets("fsdp") == (("0.9.1", "verl091_fsdp"), ("0.8.0", "verl080_fsdp"))
    assert verl_patchsets("no_such_engine") == ()


def test_the_cpu_support_knows_every_release_of_the_table():
    assert set(RELEASE_PATCHES) == set(VERL_RELEASES)
    assert all(RELEASE_PATCHES.values())
