// The HS_* environment settings are read in one place (core/settings.h) and documented in one table
// (docs/architecture.md, "Settings").
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/settings.h"
#include "test_util.h"

namespace hs {
namespace {

namespace fs = std::filesystem;

std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Settings, NoSourceReadsAnHsVariableOutsideTheTable) {
  const fs::path src = fs::path(test::source_dir()) / "src";
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".inc")) continue;
    ++files;
    if (e.path().filename() == "settings.cpp") continue;
    const std::string text = read_all(e.path());
    EXPECT_EQ(text.find("getenv(\"HS_"), std::string::npos)
        << e.path() << " reads an HS_* variable itself: add it to core/settings.cpp and read it through settings::value";
  }
  EXPECT_GT(files, 50);
}

TEST(Settings, EveryOneIsInTheDocumentedTableAndReadsTheEnvironment) {
  const std::string doc = read_all(fs::path(test::source_dir()) / "docs" / "architecture.md");
  for (const settings::Info& i : settings::all()) {
    EXPECT_NE(doc.find(std::string("`") + i.name + "`"), std::string::npos) << i.name << " is not in docs/architecture.md";
    EXPECT_STREQ(settings::name(i.setting), i.name);
  }
  const settings::Setting s = settings::Setting::FusedSpin;
  const char* before = std::getenv(settings::name(s));
  const std::string saved = before ? before : "";
  setenv(settings::name(s), "", 1);
  EXPECT_EQ(settings::value(s), nullptr);  // empty counts as unset
  setenv(settings::name(s), "17", 1);
  ASSERT_NE(settings::value(s), nullptr);
  EXPECT_STREQ(settings::value(s), "17");
  EXPECT_NE(settings::describe_set().find("HS_FUSED_SPIN=17\n"), std::string::npos) << settings::describe_set();
  if (before) setenv(settings::name(s), saved.c_str(), 1);
  else unsetenv(settings::name(s));
}

}  // namespace
}  // namespace hs
