# The two commands of the README: `make demo` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: deps configure build demo test bench sanitize clean

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./scripts/demo.sh $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1200

bench: build
	$(BUILD)/bench/shardopt-bench kernel
	$(BUILD)/bench/shardopt-bench e2e
	PYTHONPATH=$(BUILD)/python /usr/bin/python3 bench/remote_adamw_bench.py --server_binary=$(BUILD)/server/shardopt-server

# The suite again under ASAN and UBSAN, in a build of its own (README).
sanitize: deps
	JOBS=$(JOBS) ./scripts/sanitize.sh $(BUILD)-asan

clean:
	rm -rf $(BUILD)
