#include <epmoe/buffer.hpp>
#include <cstdio>
int main() { std::puts("epmoe"); return 0; }
