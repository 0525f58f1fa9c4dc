"""pytest configuration shared by the unit tests and nbval."""


def pytest_collectstart(collector):
    """nbval: do not compare SVG renders (graphviz and matplotlib versions vary) or stderr."""
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("image/svg+xml", "image/png", "text/html", "stderr")
