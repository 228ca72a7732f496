"""``dppvi deploy``: the command, its error without Flower, and the files it hands to Flower."""

import builtins
import tomllib

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install numpyro_dppvi[flower]")

from numpyro_dppvi import cli
from numpyro_dppvi.flower.demo import demo_run_config
from numpyro_dppvi.flower.federation import app_pyproject, free_ports, toml_table
from numpyro_dppvi.flower.server_app import RUN_CONFIG_DEFAULTS, ServerSettings


def test_deploy_demo_help_describes_it(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["deploy", "demo", "--help"])
    assert stop.value.code == 0
    assert "--rounds" in capsys.readouterr().out


def test_deploy_without_flower_names_the_extra(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_flower(name, *args, **kwargs):
        if name == "flwr" or name.startswith("flwr."):
            raise ImportError("No module named 'flwr'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flower)
    assert cli.main(["deploy", "demo"]) == 2
    assert "pip install numpyro_dppvi[flower]" in capsys.readouterr().err


def test_the_app_bundle_names_installed_components_and_every_run_config_key():
    project = tomllib.loads(app_pyproject())
    flwr = project["tool"]["flwr"]["app"]
    assert flwr["components"] == {"serverapp": "numpyro_dppvi.flower.server_app:app",
                                  "clientapp": "numpyro_dppvi.flower.client_app:app"}
    assert flwr["config"] == RUN_CONFIG_DEFAULTS
    assert ServerSettings.from_run_config(demo_run_config(3, "results")).rounds == 3


def test_config_files_keep_awkward_strings():
    values = {"state-dir": 'C:\\data dir\\"x"', "epsilon": 0.5, "allow-non-private": False, "rounds": 3}
    assert tomllib.loads(toml_table(values)) == values


def test_free_ports_are_distinct():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= p < 65536 for p in ports)
