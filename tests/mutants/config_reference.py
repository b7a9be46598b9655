"""Broken builds of the configuration reference and the JSON Schema's descriptions: a
setting's meaning lost, a default shown wrong, a shorthand the schema refuses."""

from tests.mutants import Mutant

R = "tests/test_config_reference.py::"
S = "tests/test_config_schema.py::"

MUTANTS = [
    Mutant(
        name="field-docstrings-ignored",
        path="gateway/config/sections.py",
        old="            isinstance(previous, ast.AnnAssign)",
        new="            isinstance(previous, ast.Assign)",
        tests=(
            R + "test_every_declared_setting_has_a_description",
            R + "test_every_setting_in_the_json_schema_has_a_description",
        ),
        breaks="settings lose their meaning: the JSON Schema and the reference describe nothing",
    ),
    Mutant(
        name="reference-row-skips-blocks",
        path="gateway/config/reference.py",
        old="                for field_name in sorted(under, key=lambda f: written_at[f]):",
        new="                for field_name in []:",
        tests=(R + "test_the_reference_names_every_setting_of_the_json_schema",),
        breaks="the reference leaves out match.path, sentinel.nodes and the other settings "
        "written inside a block",
    ),
    Mutant(
        name="statuses-written-unreadable",
        path="gateway/config/units.py",
        old="            left_out += [f'\"!{status}\"' for status in sorted(whole - inside)]",
        new="            pass",
        tests=(R + "test_a_status_set_as_written_reads_back_the_same",),
        breaks="a default status set is shown as a list that reads back as another set",
    ),
    Mutant(
        name="delivery-shorthand-refused-by-schema",
        path="gateway/config/schema.py",
        old='{"anyOf": [{"enum": list(get_args(DeliveryMode))}, ENV, mapping]}',
        new="mapping",
        tests=(S + "test_the_schema_accepts_settings_as_users_write_them",),
        breaks="an editor flags `delivery: async`, which the gateway accepts, as an error",
    ),
]
