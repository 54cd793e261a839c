"""Checks shared by the labs' otter tests.

``form`` holds the form checks and evidence helpers students may see; each ``labN`` module
holds the hidden checks of one lab. ``jaxlab release`` ships them into the releases as flat
modules named ``jaxlab_<module>.py`` (see ``jaxlab.release``).
"""
