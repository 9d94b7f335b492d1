"""A preset's Hugging Face field of the wrong type is one ConfigError when the config is built
(issue 38, item 8: model.overrides.hidden_size=abc was 40 lines of huggingface_hub's traceback
when the job first built the preset's config)."""
import pytest

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError


@pytest.mark.parametrize("override,field", [("model.overrides.hidden_size=abc", "hidden_size"),
                                            ("model.overrides.num_hidden_layers=[1,2]", "num_hidden_layers")])
def test_a_wrongly_typed_override_is_one_line_naming_the_field(override, field):
    with pytest.raises(ConfigError) as raised:
        load_config([override])
    message = str(raised.value)
    assert message.startswith("model.overrides: ") and field in message and "\n" not in message


def test_a_well_typed_override_still_builds():
    assert load_config(["model.overrides.hidden_size=64"]).model.overrides["hidden_size"] == 64
