"""JupyterLab settings the course ships (`make lab` and tests/course/browser point JUPYTER_CONFIG_PATH here).

They add to your own Jupyter configuration; nothing here is written to your home directory.

* The file browser hides the lectures' helper packages (notebooks/lectureNN/): a newcomer sees
  the lecture notebooks. The notebooks import them as before, and File > Open from Path...
  (e.g. `lecture01/race.py`) opens their code.
* JupyterLab's default settings come from ./lab/overrides.json (no news pop-up, ...).
"""

from pathlib import Path

from jupyter_server.services.contents.manager import ContentsManager

c = get_config()  # noqa: F821 (defined by Jupyter when it loads this file)

c.ContentsManager.hide_globs = [*ContentsManager.hide_globs.default(), "lecture[0-9][0-9]"]
c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab")
