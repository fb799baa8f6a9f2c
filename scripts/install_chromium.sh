#!/usr/bin/env bash
# Install Debian's chromium and chromedriver (for tests/test_playground.py) when they are not on PATH; without
# apt-get or root it only warns, and the playground test skips.
exec bash "$(dirname "$0")/apt_install.sh" optional "tests/test_playground.py" chromium chromedriver -- chromium chromium-driver
