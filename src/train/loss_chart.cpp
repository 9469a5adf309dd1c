#include "train/loss_chart.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace hs::train {

void write_svg_chart(const std::string& path, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Series>& series) {
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto& s : series)
    for (auto [x, y] : s.points) {
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (x0 > x1) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double W = 720, Hh = 420, L = 70, R = 20, T = 40, B = 50;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * (Hh - T - B); };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << Hh
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << title << "</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << Hh - B << "\" x2=\"" << W - R << "\" y2=\"" << Hh - B << "\" stroke=\"black\"/>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << Hh - B << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    double yv = y0 + (y1 - y0) * i / 5, xv = x0 + (x1 - x0) * i / 5;
    char b[64];
    std::snprintf(b, sizeof b, "%.3g", yv);
    o << "<text x=\"" << L - 6 << "\" y=\"" << py(yv) + 4 << "\" text-anchor=\"end\">" << b << "</text>\n";
    o << "<line x1=\"" << L << "\" y1=\"" << py(yv) << "\" x2=\"" << W - R << "\" y2=\"" << py(yv) << "\" stroke=\"#eee\"/>\n";
    std::snprintf(b, sizeof b, "%.0f", xv);
    o << "<text x=\"" << px(xv) << "\" y=\"" << Hh - B + 18 << "\" text-anchor=\"middle\">" << b << "</text>\n";
  }
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << Hh - 10 << "\" text-anchor=\"middle\">" << xlabel << "</text>\n";
  o << "<text x=\"16\" y=\"" << (T + Hh - B) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " << (T + Hh - B) / 2
    << ")\">" << ylabel << "</text>\n";
  int li = 0;
  for (const auto& s : series) {
    o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.5\" points=\"";
    for (auto [x, y] : s.points) o << px(x) << "," << py(y) << " ";
    o << "\"/>\n<text x=\"" << W - R - 150 << "\" y=\"" << T + 16 * (li + 1) << "\" fill=\"" << s.color << "\">" << s.name
      << "</text>\n";
    ++li;
  }
  o << "</svg>\n";
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << o.str();
    if (!f) throw std::runtime_error("cannot write '" + tmp + "'");
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace hs::train
