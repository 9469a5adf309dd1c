// The loss curve a training run leaves in <out>/loss.svg: a plain SVG line chart.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace hs::train {

// Writes an SVG line chart of (x, y) series to `path` (atomically).
struct Series { std::string name, color; std::vector<std::pair<double, double>> points; };
void write_svg_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Series>& series);

}  // namespace hs::train
