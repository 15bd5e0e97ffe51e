import pytest

from pipeline.models.presets import PRESETS, get_preset


def test_every_preset_names_a_hub_repo_and_a_size():
    for preset in PRESETS.values():
        org, _, repo = preset.hub_id.partition("/")
        assert org and repo, preset.name
        assert preset.params_b > 0


@pytest.mark.parametrize("typed, name", [
    ("smollm2-135m", "smollm2-135m"),
    ("SmolLM2-135M", "smollm2-135m"),
    ("llama-70b", "llama-3.3-70b"),
    ("LLAMA-70B", "llama-3.3-70b"),
    ("  llama-3.1-8b ", "llama-3.1-8b"),
])
def test_lookup_ignores_case_and_accepts_aliases(typed, name):
    assert get_preset(typed).name == name


def test_unknown_name_is_none():
    assert get_preset("gpt-5") is None


def test_only_smollm2_is_embedded():
    assert [p.name for p in PRESETS.values() if p.embedded] == ["smollm2-135m"]
    assert PRESETS["smollm2-135m"].hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.3-70b"])
def test_large_llamas_have_an_eagle3_head_and_a_draft_that_is_a_preset(name):
    preset = PRESETS[name]
    assert preset.eagle3_head.startswith("yuhuili/EAGLE3-")
    assert preset.recommended_draft in PRESETS


def test_every_recommended_draft_is_a_smaller_preset():
    for preset in PRESETS.values():
        if preset.recommended_draft:
            draft = PRESETS[preset.recommended_draft]
            assert draft.params_b < preset.params_b


def test_aliases_are_unique_across_presets():
    names = [n for p in PRESETS.values() for n in (p.name, *p.aliases)]
    assert len(names) == len(set(names))
