def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "container: builds and runs a container image with buildah/podman (deploy/build_local.sh, ~10 min on "
        "2 CPU cores); runs in CI, skips where the container tools cannot run")
